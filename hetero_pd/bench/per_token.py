"""`hetero-pd bench per-token`: what serving pays per streamed token outside the model, the old
way and the new side by side in one process.

- detokenize: the Python window (`IncrementalDetokenizer`, two `decode` calls per token
  from Python) against tokenizers' `DecodeStream` (`StreamDetokenizer`), over the same
  output ids of the default model's tokenizer (English, CJK, emoji: characters split
  across tokens), both decoding through the engine's `load_decoder`;
- encode: one chat chunk per token as the API streams it, `json.dumps` against msgspec's
  encoder (`responses.sse`).

The ways take turns over `--rounds`; each prints its median microseconds per token, and the
ratio old/new. Both detokenizers must give the same text. The last stdout line is one JSON
object with the machine.

    hetero-pd bench per-token [--tokens 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from hetero_pd.bench.machine import cpu_info
from hetero_pd.engine.detokenizer import detokenizer
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model
from hetero_pd.models.tokenizer import load_decoder, load_tokenizer
from hetero_pd.serving.api.responses import sse

TEXT = (
    "The cache moves between devices while tokens stream back to the user. "
    "你好，世界！今天天气很好。 Emoji: 🎉🚀 👨‍👩‍👧 naïve café, Łódź, русский текст. "
    "def f(x):\n    return x ** 2  # ✓\n"
)


def chunk(text: str) -> dict[str, Any]:
    """A chat chunk as `responses.chat_chunk` builds it, carrying one token's text."""
    return {
        "id": "chatcmpl-3f2a9c1b7e4d4a0c9b8f6e5d4c3b2a10",
        "object": "chat.completion.chunk",
        "created": 1764720000,
        "model": "smollm2-135m-instruct",
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        ],
    }


def old_sse(data: dict[str, Any]) -> bytes:
    """`responses.sse` before msgspec: json.dumps per chunk."""
    text = json.dumps(data, separators=(",", ":"))
    return "".join(f"data: {line}\n" for line in text.split("\n")).encode() + b"\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench per-token", description=__doc__)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    path = resolve_model(DEFAULT_MODEL)
    tokenizer, decoder = (
        load_tokenizer(path),
        load_decoder(path),
    )  # the engine decodes with the latter
    ids = tokenizer.encode(TEXT * (args.tokens // 40 + 1))[: args.tokens]
    prompt = tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n")
    texts: dict[bool, str] = {}

    def detok(stream: bool) -> Callable[[], None]:
        def run() -> None:
            d = detokenizer(decoder, prompt, stream=stream)
            for token in ids:
                d.add(token)
            d.flush()
            texts[stream] = d.text

        return run

    chunks = [chunk(str(tokenizer.decode([t]))) for t in ids]
    ways: dict[str, Callable[[], object]] = {
        "detokenize python": detok(False),
        "detokenize DecodeStream": detok(True),
        "encode json.dumps": lambda: [old_sse(c) for c in chunks],
        "encode msgspec": lambda: [sse(c) for c in chunks],
    }
    us: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            us[name].append((time.perf_counter() - t0) / len(ids) * 1e6)
    if texts[False] != texts[True]:
        raise SystemExit("the detokenizers gave different texts")
    med = {name: statistics.median(t) for name, t in us.items()}
    for name, m in med.items():
        print(f"{name:24s} {m:7.2f} us per token")
    ratios = {
        "detokenize_old_over_new": med["detokenize python"] / med["detokenize DecodeStream"],
        "encode_old_over_new": med["encode json.dumps"] / med["encode msgspec"],
    }
    for name, r in ratios.items():
        print(f"{name:24s} {r:7.2f}")
    result = {
        "tokens": len(ids),
        "us_per_token": {k: round(v, 2) for k, v in med.items()},
        "ratios": {k: round(v, 2) for k, v in ratios.items()},
        "cpu": cpu_info(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
