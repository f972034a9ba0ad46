"""vLLM's side of the offline comparison in scripts/vllm_side_by_side.sh (--mode offline).

Runs in vLLM's own virtual environment (it imports nothing from hetero-pd). Reads the
workload that `side_by_side.py spec` wrote (token ids, so both sides see the same input) on
stdin, warms up on its warm-up prompts, times one greedy `LLM.generate` of the measured
prompts (EOS ignored, as hetero-pd's side does) and prints one JSON line in the shape of
hetero_pd.bench.offline_side's result, with the peak RSS of its whole process tree.

V1 runs the model in a worker process that is a child of the engine core process, itself a
child of this one, and both are killed, not waited for, at shutdown: `RUSAGE_CHILDREN` never
sees the worker (it reported 641 MB while the worker alone held 1.7 GB). So a thread samples
the PSS of this process and all its descendants (psutil, one of vLLM's dependencies) every
0.5 s and keeps the largest sum: PSS, so that libraries and shared memory mapped by all three
processes count once, not three times.
"""

from __future__ import annotations

import contextlib
import gc
import json
import resource
import sys
import threading
import time
from typing import Any


class TreePss:
    """Largest summed PSS of this process and its descendants, sampled in a thread."""

    def __init__(self, every_s: float = 0.5) -> None:
        import psutil

        self._me, self._every, self.peak_mb = psutil.Process(), every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> float:
        import psutil

        total = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # ended between listing and reading
                total += proc.memory_full_info().pss
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.peak_mb = max(self.peak_mb, self._sample())

    def stop(self) -> float:
        self.peak_mb = max(self.peak_mb, self._sample())
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def generate(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    spec = json.loads(sys.stdin.read())
    tree = TreePss()
    from vllm import LLM

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0)
    generate(llm, spec["warmup_prompts"], spec.get("warmup_tokens", 8))
    start = time.perf_counter()
    token_ids = generate(llm, spec["prompts"], spec["max_tokens"])
    elapsed = time.perf_counter() - start
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tree_peak = tree.stop()
    del llm  # vLLM's engine core may be a child process: once it ends, its peak is known
    gc.collect()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {
        "side": "vllm",
        "dtype": dtype,
        "elapsed_s": elapsed,
        "token_ids": token_ids,
        "peak_rss_mb": round(tree_peak, 1),  # PSS of this process and its children, summed
        "main_process_peak_rss_mb": round(peak, 1),
        "waited_children_peak_rss_mb": round(children, 1),  # misses killed grandchildren
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
