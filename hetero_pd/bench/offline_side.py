"""One side of `hetero-pd bench offline`, run in a process of its own.

The parent writes a `SideSpec` as JSON to stdin; this process loads its side (this engine
or transformers), warms it up on prompts of its own, times one greedy batch of the measured
prompts and prints a `SideResult` as one JSON line. Its own peak RSS is then the side's
alone: nothing the other side loaded is in this process.

Both sides get the same token ids and generate exactly ``max_tokens`` tokens per prompt
without suppressing EOS (the engine's ``ignore_eos``; transformers with no EOS id, which is
not ``min_new_tokens``: that masks EOS out of the logits and changes the greedy choice).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch loads with a side (`run_side`), not with this module's types
    import torch

# "eager": this engine with its compiled step off, the baseline `--eager-baseline` adds.
Side = Literal["engine", "eager", "transformers"]
SIDES: tuple[Side, ...] = ("engine", "eager", "transformers")


@dataclass(frozen=True, slots=True)
class SideSpec:
    side: Side
    model: str
    dtype: str
    threads: int
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    max_tokens: int
    warmup_tokens: int = 8
    kv_cache_gb: float = 1.0
    compile: str = "auto"  # the engine side's EngineConfig.compile


@dataclass(frozen=True, slots=True)
class SideResult:
    side: Side
    dtype: str  # what the weights actually were, not what was asked for
    elapsed_s: float
    token_ids: list[list[int]]
    peak_rss_mb: float
    compiled: bool = False  # the engine's decode step ran compiled

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed_s


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_dtype(llm: Any) -> str:
    """The dtype the engine chose (``auto`` resolved), read from its weights."""
    return dtype_name(next(iter(llm.engine.runner.model.parameters())).dtype)


def run_engine(spec: SideSpec) -> tuple[str, float, list[list[int]], bool]:
    from hetero_pd import LLM, SamplingParams

    n = max(len(spec.prompts), len(spec.warmup_prompts), 1)
    llm = LLM(
        spec.model,
        dtype=spec.dtype,
        max_num_seqs=n,
        num_threads=spec.threads,
        kv_cache_gb=spec.kv_cache_gb,
        compile="off" if spec.side == "eager" else spec.compile,
    )
    warm = SamplingParams(temperature=0, max_tokens=spec.warmup_tokens, ignore_eos=True)
    llm.generate(spec.warmup_prompts, warm)
    params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(spec.prompts, params)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return engine_dtype(llm), elapsed, ids, llm.engine.runner.compiled


def _left_padded(prompts: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    import torch

    width = max(len(p) for p in prompts)
    ids = [[pad] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def run_transformers(spec: SideSpec) -> tuple[str, float, list[list[int]], bool]:
    import torch
    from transformers import AutoModelForCausalLM

    from hetero_pd.config import parse_dtype
    from hetero_pd.models.fetch import resolve_model

    torch.set_num_threads(spec.threads)
    path = resolve_model(spec.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(spec.dtype)).eval()
    model.generation_config.eos_token_id = None  # generate past EOS, like ignore_eos
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad)

    def generate(prompts: list[list[int]], n: int) -> torch.Tensor:
        batch = _left_padded(prompts, pad)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=n, do_sample=False, pad_token_id=pad)
        return out[:, batch["input_ids"].shape[1] :]

    generate(spec.warmup_prompts, spec.warmup_tokens)
    start = time.perf_counter()
    new = generate(spec.prompts, spec.max_tokens)
    elapsed = time.perf_counter() - start
    return dtype_name(model.dtype), elapsed, new.tolist(), False


def run_side(spec: SideSpec) -> SideResult:
    run = run_transformers if spec.side == "transformers" else run_engine
    dtype, elapsed, token_ids, compiled = run(spec)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return SideResult(spec.side, dtype, elapsed, token_ids, round(peak, 1), compiled)


def main() -> int:
    raw = json.loads(sys.stdin.read())
    if raw.get("side") not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {raw.get('side')!r}")
    result = run_side(SideSpec(**raw))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    from hetero_pd.process_exit import exit_after

    exit_after(main)
