"""vLLM's side of the offline comparison in scripts/vllm_side_by_side.sh (--mode offline).

Runs in vLLM's own virtual environment (it imports nothing from hetero-pd). Reads the
workload that `side_by_side.py spec` wrote (token ids, so both sides see the same input) on
stdin, warms up on its warm-up prompts, times one greedy `LLM.generate` of the measured
prompts (EOS ignored, as hetero-pd's side does) and prints one JSON line in the shape of
hetero_pd.bench.offline_side's result: its own peak RSS, and that of vLLM's engine core
process when it runs in one (V1's default) and has ended.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from typing import Any


def generate(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    spec = json.loads(sys.stdin.read())
    from vllm import LLM

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0)
    generate(llm, spec["warmup_prompts"], spec.get("warmup_tokens", 8))
    start = time.perf_counter()
    token_ids = generate(llm, spec["prompts"], spec["max_tokens"])
    elapsed = time.perf_counter() - start
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del llm  # vLLM's engine core may be a child process: once it ends, its peak is known
    gc.collect()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {
        "side": "vllm",
        "dtype": dtype,
        "elapsed_s": elapsed,
        "token_ids": token_ids,
        "peak_rss_mb": round(peak, 1),
        "engine_core_peak_rss_mb": round(children, 1),  # 0.0: none ended (or none ran)
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
