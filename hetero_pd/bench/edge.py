"""`hetero-pd bench edge`: an edge mode against the unsplit stack, on loopback, in one run.

1. The split planner is fed measured numbers: the device's runtime timed end to end
   (`profile_runtime`), every cloud layer timed (`profile_layers`), the loopback link probed
   (`measure_link`); it prints its table and predicts TTFT and TPOT for the chosen k.
2. An unsplit deployment (1 prefill + 1 decode worker, whole model) serves the prompts as
   token ids over /v1/completions (streamed); then a second one serves them to an EdgeClient
   that runs layers [0, k) in this process, in `--mode`:
   - split: the workers run layers [k, L); the device runs its layers on every generated
     token too, so each token costs a device <-> cloud round trip. Over TLS to the edge
     listener.
   - prompt_only: whole-model workers; the device runs its layers on the prompt only and
     sends their KV with it, the cloud decodes alone (no bytes per generated token). In
     clear on the API's port: whole-model deployments have no edge listener (README).
   Requests go one at a time: this measures latency, not throughput.
3. It reports bytes the device put on the wire per prompt and per generated token, TTFT and
   TPOT of both, and the planner's raw prediction error against each measurement. The
   planner prices layers and the link only; the serving path (router, ZMQ hops, the KV
   hand-off) is not in its model, so its error includes that cost. The unsplit run's
   measured-minus-predicted gap is printed as the serving path's cost, for information:
   it is never used to correct a prediction with the same run's measurement. The planner
   models split mode only: with --mode prompt_only its split prediction is printed for
   comparison and no planner error is computed against the prompt_only run.

TTFT is from sending (for the edge run: from the call, which tokenizes and runs the
device's layers first) to the first token; TPOT is, for both, (last token - first token) /
(tokens - 1), with tokens counted by the server (unsplit) or the device (edge).

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import torch

from edge.client import EdgeClient
from edge.codec import CODECS, decode, encode
from edge.link_probe import measure_link, serve_link_probe
from edge.planner import SplitPrediction, format_plan, plan_split
from edge.profiling import profile_layers, profile_runtime
from edge.runtime import EdgeRuntime
from hetero_pd.bench.client import build_payload, send_request
from hetero_pd.bench.datasets import BenchRequest
from hetero_pd.bench.edge_agreement import CloudReference
from hetero_pd.bench.link_shaping import LINKS, LinkSpec, via
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.testing import deployment, running_stack
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.api.edge_protocol import MODES

PROG = "hetero-pd bench edge"
TOPICS = (
    "the history of lighthouses",
    "how bread rises",
    "why the sky is blue",
    "the rules of chess",
    "how a bicycle stays upright",
    "what a compiler does",
    "the water cycle",
    "how vaccines train the immune system",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--split", type=int, default=4, help="split layer k (default 4)")
    p.add_argument(
        "--mode",
        default="split",
        choices=MODES,
        help="split: a round trip per generated token; prompt_only: the device's layers on the "
        "prompt only, whole-model workers decode alone (sends early KV: see edge-privacy)",
    )
    p.add_argument("--codec", default="float16", choices=CODECS)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=60, help="words per prompt (about)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--link",
        default="loopback",
        choices=("loopback", *LINKS),
        help="device -> cloud link, shaped by a proxy (hetero_pd.bench.link_shaping)",
    )
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 2 or args.prompt_words < 1:
        p.error("--num-prompts >= 1, --max-tokens >= 2 and --prompt-words >= 1 are required")
    return args


def prompts(n: int, words: int) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        filler = " ".join(f"Consider {topic} step {j}." for j in range(max(1, words // 5)))
        out.append(f"Explain {topic} in plain words. {filler}")
    return out


def plan(
    model_dir: Path,
    args: argparse.Namespace,
    prompt_len: int,
    runtime: EdgeRuntime,
    spec: LinkSpec | None,
) -> tuple[SplitPrediction, SplitPrediction, str, dict[str, Any]]:
    """(prediction at --split, unsplit prediction, the planner's table, inputs)."""
    cfg = ModelConfig.from_dir(model_dir)
    lens = sorted({max(1, prompt_len // 2), prompt_len, prompt_len * 2})
    edge = profile_runtime(runtime, cfg.num_layers, lens)
    cloud = profile_layers(model_dir, "cpu", lens)
    with serve_link_probe() as (host, port), via(f"tcp://{host}:{port}", spec) as probe:
        parts = urlsplit(probe)
        link = measure_link(parts.hostname or host, parts.port or port)
    result = plan_split(
        edge,
        cloud,
        link,
        prompt_len=prompt_len,
        hidden_size=cfg.hidden_size,
        codec=args.codec,
        objective="latency",
        output_tokens=args.max_tokens,
    )
    chosen = next(p for p in result.candidates if p.split_layer == args.split)
    inputs = {"link_rtt_ms": link.rtt_s * 1e3, "link_gbps": link.bandwidth_bps * 8 / 1e9}
    inputs["recommended_split"] = result.best.split_layer
    return chosen, result.unsplit, format_plan(result), inputs


async def unsplit_run(
    url: str, model: str, ids: list[list[int]], max_tokens: int
) -> list[dict[str, float]]:
    out = []
    async with aiohttp.ClientSession() as session:
        for prompt in ids:
            req = BenchRequest("", len(prompt), max_tokens)
            body = build_payload("completions", model, req, ignore_eos=True)
            body["prompt"] = prompt  # token ids: the split run tokenizes on the device
            r = await send_request(session, url + "/v1/completions", "completions", body, req)
            if not r.success:
                raise RuntimeError(f"unsplit request failed: {r.error}")
            last = r.ttft + sum(r.itl)  # the last content chunk
            out.append(_timing(r.ttft, last, r.output_tokens, len(json.dumps(body))))
    return out


async def edge_run(
    url: str,
    model: str,
    model_dir: Path,
    args: argparse.Namespace,
    ids: list[list[int]],
    ca_file: Path | None = None,
) -> list[dict[str, float]]:
    """The edge sessions in `args.mode`: over TLS to the edge listener (`ca_file`: its
    certificate), or in clear to the API's port when `ca_file` is None."""
    runtime = EdgeRuntime(model_dir, args.split)
    out = []
    for prompt in ids:
        sent: list[int] = []
        client = EdgeClient(
            url,
            model_dir,
            args.split,
            model=model,
            codec=args.codec,
            runtime=runtime,
            tap=_counter(sent),
            mode=args.mode,
            ca_file=ca_file,
            plaintext=ca_file is None,
        )
        done = await client.complete(prompt, max_tokens=args.max_tokens, ignore_eos=True)
        t = done.token_times_s
        timing = _timing(t[0], t[-1], len(done.token_ids), sent[0])
        # prompt_only: the start message is all the device sends, so 0 per token.
        timing["bytes_per_token"] = statistics.mean(sent[1:]) if len(sent) > 1 else 0.0
        out.append(timing)
    return out


def codec_agreement(model_dir: Path, split: int, codec: str, prompts: list[list[int]]) -> float:
    """Teacher-forced greedy agreement: at every prompt position, the next token the model
    picks from layer `split`'s input sent through `codec` equals the one it picks unsplit."""
    cloud = CloudReference(model_dir, ModelConfig.from_dir(model_dir), prompts, [split])
    return cloud.agreement(split, lambda h: decode(encode(h, codec)))


def _counter(sizes: list[int]) -> Callable[[bytes], None]:
    def count(message: bytes) -> None:
        sizes.append(len(message))

    return count


def tpot_s(first_s: float, last_s: float, tokens: int) -> float:
    """The one TPOT of this benchmark, split and unsplit: first to last token, per token."""
    return (last_s - first_s) / (tokens - 1) if tokens > 1 else 0.0


def _timing(first_s: float, last_s: float, tokens: int, prompt_bytes: int) -> dict[str, float]:
    return {
        "ttft_s": first_s,
        "tpot_s": tpot_s(first_s, last_s, tokens),
        "prompt_bytes": float(prompt_bytes),
        "tokens": float(tokens),
    }


def error_pct(predicted: float, measured: float) -> float | None:
    """The planner's raw error: |predicted - measured| / measured, in percent; None when
    nothing was measured (every token of a stream arrived in one chunk: TPOT 0)."""
    return abs(predicted - measured) / measured * 100 if measured > 0 else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _show(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _known(errors: dict[str, float | None]) -> list[float]:
    return [e for e in errors.values() if e is not None]


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def edge_deployment(
    model_dir: Path, args: argparse.Namespace, router: dict[str, Any], engine: dict[str, Any]
) -> Deployment:
    """The deployment `args.mode` talks to: split workers behind the TLS edge listener, or
    (prompt_only) whole-model workers, which have no edge listener."""
    if args.mode == "prompt_only":
        return deployment(model_dir, router=router, engine=engine)
    edge = {"split_layer": args.split, "codec": args.codec}
    return deployment(model_dir, router=router, engine=engine, edge=edge)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    if not 1 <= args.split < cfg.num_layers:
        print(f"{PROG}: --split must be in [1, {cfg.num_layers})", file=sys.stderr)
        return 2
    runtime = EdgeRuntime(model_dir, args.split)
    spec = LINKS.get(args.link)
    texts = prompts(args.num_prompts, args.prompt_words)
    ids = [runtime.tokenize(t) for t in texts]
    prompt_len = round(statistics.mean(len(i) for i in ids))
    # A prompt of its own: a measured one must not hit the unsplit workers' prefix cache.
    warmup = [runtime.tokenize("Warming up: " + prompts(1, args.prompt_words)[0][::-1])]
    print(
        f"workload: {len(ids)} prompts of ~{prompt_len} tokens, {args.max_tokens} new tokens "
        f"each, one at a time; {args.mode} k={args.split} of {cfg.num_layers} layers, codec "
        f"{args.codec}; workers 1P1D, {args.threads} thread(s) each; link: "
        f"{spec.describe() if spec else 'loopback'}",
        flush=True,
    )
    chosen, unsplit_pred, table, inputs = plan(model_dir, args, prompt_len, runtime, spec)
    print(table, flush=True)
    if args.mode != "split":
        print(
            f"(the planner models split mode, a round trip per generated token; this run is "
            f"{args.mode}: its numbers are printed beside the split prediction, not scored)",
            flush=True,
        )
    engine = {"num_threads": args.threads, "max_model_len": min(2048, cfg.max_position_embeddings)}
    router = {"local_prefill_max_tokens": 0}  # every prompt through the KV hand-off
    with (
        running_stack(deployment(model_dir, router=router, engine=engine)) as stack,
        via(stack.url, spec) as url,
    ):
        asyncio.run(unsplit_run(url, stack.dep.model, warmup, 2))
        unsplit = asyncio.run(unsplit_run(url, stack.dep.model, ids, args.max_tokens))
    with running_stack(edge_deployment(model_dir, args, router, engine)) as stack:
        ca = stack.edge_ca  # None: no edge listener, in clear to the API's port
        with via(stack.edge_url or stack.url, spec) as url:
            asyncio.run(edge_run(url, stack.dep.model, model_dir, args, warmup, ca))
            edged = asyncio.run(edge_run(url, stack.dep.model, model_dir, args, ids, ca))
    agreement = codec_agreement(model_dir, args.split, args.codec, ids)
    mode = args.mode
    m = {
        "unsplit_ttft": _mean(unsplit, "ttft_s"),
        "unsplit_tpot": _mean(unsplit, "tpot_s"),
        "edge_ttft": _mean(edged, "ttft_s"),
        "edge_tpot": _mean(edged, "tpot_s"),
    }
    # Raw errors: the planner's predictions against this run, corrected with nothing from it.
    errors = {
        "ttft": error_pct(chosen.ttft_s, m["edge_ttft"]),
        "tpot": error_pct(chosen.tpot_s, m["edge_tpot"]),
    }
    err_unsplit_ttft = error_pct(unsplit_pred.ttft_s, m["unsplit_ttft"])
    err_unsplit_tpot = error_pct(unsplit_pred.tpot_s, m["unsplit_tpot"])
    serve_ttft = m["unsplit_ttft"] - unsplit_pred.ttft_s  # for information only
    serve_tpot = m["unsplit_tpot"] - unsplit_pred.tpot_s
    ratios = {n: _ratio(m[f"edge_{n}"], m[f"unsplit_{n}"]) for n in ("ttft", "tpot")}
    ms = 1e3
    print(
        f"unsplit: TTFT {m['unsplit_ttft'] * ms:.1f} ms, TPOT {m['unsplit_tpot'] * ms:.1f} ms; "
        f"planner {unsplit_pred.ttft_s * ms:.1f} / {unsplit_pred.tpot_s * ms:.1f} ms: error "
        f"{_show(err_unsplit_ttft, '.1f')}% / {_show(err_unsplit_tpot, '.1f')}% (the serving "
        f"path, which the planner does not model, took {serve_ttft * ms:.1f} / "
        f"{serve_tpot * ms:.1f} ms)"
    )
    predicted = f"{chosen.ttft_s * ms:.1f} / {chosen.tpot_s * ms:.1f} ms"
    if mode == "split":
        shown = [_show(errors[n], ".1f") for n in ("ttft", "tpot")]
        verdict = f"planner {predicted}: error {shown[0]}% / {shown[1]}%"
    else:  # the planner's model has a round trip per token: not this mode's cost
        verdict = f"the planner models split mode only (its split prediction: {predicted})"
        errors = {}
    print(
        f"{mode} k={args.split}: TTFT {m['edge_ttft'] * ms:.1f} ms, TPOT "
        f"{m['edge_tpot'] * ms:.1f} ms ({_show(ratios['ttft'], '.2f')}x / "
        f"{_show(ratios['tpot'], '.2f')}x "
        f"unsplit); {verdict}"
    )
    bytes_prompt = _mean(edged, "prompt_bytes")
    bytes_token = _mean(edged, "bytes_per_token")
    what = "hidden states" if mode == "split" else f"hidden states and layers [0, {args.split})' KV"
    print(
        f"device -> cloud ({'TLS, edge listener' if ca else 'in clear, the API port'}): "
        f"{bytes_prompt:.0f} B per prompt of {what} ({bytes_prompt / prompt_len:.0f} B per "
        f"prompt token), {bytes_token:.0f} B per generated token; the unsplit request body "
        f"was {_mean(unsplit, 'prompt_bytes'):.0f} B of JSON token ids"
    )
    print(
        f"codec {args.codec}: greedy next-token agreement with the unsplit model over "
        f"{sum(len(i) for i in ids)} prompt positions (teacher-forced, hidden states only): "
        f"{agreement * 100:.2f}%"
    )
    result = {
        "model": args.model,
        "mode": mode,
        "split_layer": args.split,
        "codec": args.codec,
        "link": args.link,
        "tls": ca is not None,
        "num_prompts": len(ids),
        "prompt_tokens": prompt_len,
        "max_tokens": args.max_tokens,
        f"{mode}_tokens": round(sum(r["tokens"] for r in edged)),
        "unsplit_tokens": round(sum(r["tokens"] for r in unsplit)),
        "bytes_per_prompt": round(bytes_prompt),
        "bytes_per_token": round(bytes_token),
        f"{mode}_ttft_ms": round(m["edge_ttft"] * ms, 2),
        "unsplit_ttft_ms": round(m["unsplit_ttft"] * ms, 2),
        f"{mode}_tpot_ms": round(m["edge_tpot"] * ms, 2),
        "unsplit_tpot_ms": round(m["unsplit_tpot"] * ms, 2),
        "ttft_vs_unsplit": _rounded(ratios["ttft"], 3),
        "tpot_vs_unsplit": _rounded(ratios["tpot"], 3),
        "predicted_mode": "split",  # predicted_ttft/tpot_ms are the split mode's, always
        "predicted_ttft_ms": round(chosen.ttft_s * ms, 2),
        "predicted_tpot_ms": round(chosen.tpot_s * ms, 2),
        "predicted_unsplit_ttft_ms": round(unsplit_pred.ttft_s * ms, 2),
        "predicted_unsplit_tpot_ms": round(unsplit_pred.tpot_s * ms, 2),
        **{f"planner_{n}_error_pct": _rounded(e, 1) for n, e in errors.items()},
        **({"planner_error_pct": round(max(known), 1)} if (known := _known(errors)) else {}),
        "planner_unsplit_ttft_error_pct": _rounded(err_unsplit_ttft, 1),
        "planner_unsplit_tpot_error_pct": _rounded(err_unsplit_tpot, 1),
        "serving_path_ttft_ms": round(serve_ttft * ms, 2),
        "serving_path_tpot_ms": round(serve_tpot * ms, 2),
        "codec_token_agreement_pct": round(agreement * 100, 2),
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in inputs.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
