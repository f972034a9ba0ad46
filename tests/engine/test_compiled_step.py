"""The compiled decode step gives the same greedy tokens as eager and as transformers, with
dynamic shapes (cpu) and with padded static shapes (what CUDA graphs and NPU graph mode
replay); with dynamic shapes it compiles once at start and never again while serving, even
when the thread count changes under it.

These tests compile (a minute or so each on 2 cores), so they are the only ones that do."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends import get_backend
from backends.compiler import StepPadding
from hetero_pd import LLM, SamplingParams

Ref = Callable[..., list[int]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in [3, 17, 90, 1, 41, 64, 8]]


def graphs() -> int:
    # Imported here, not at the top: importing dynamo costs seconds at every collection.
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_compiled(path: Path, seed: int, hf_greedy: Ref) -> LLM:
    # Steps compiled earlier in this process (other tests' engines, under xdist) hold cache
    # entries of the same code: start from none, so a recompile counted below is this one's.
    torch._dynamo.reset()
    # A 40-token budget mixes chunked prefills (eager) with decode batches (compiled), and
    # batch sizes shrink to 1 (eager) as requests finish. One thread to start, and no thread
    # governor (it follows the load of whatever else runs on the machine): the test changes
    # the count itself, as the governor would, and the step must not compile again.
    llm = LLM(
        str(path),
        dtype="float32",
        compile="on",
        num_threads=1,
        max_num_batched_tokens=40,
        block_size=8,
        num_kv_blocks=128,
    )
    assert llm.engine.runner.compiled
    assert "decode step compiled (configured)" in llm.engine.describe()
    compiled_at_start = graphs()
    batch = prompts(seed)
    threads = torch.get_num_threads()
    try:
        outs = llm.generate(batch[:4], PARAMS)
        torch.set_num_threads(2)
        outs += llm.generate(batch[4:], PARAMS)
    finally:
        torch.set_num_threads(threads)
    if llm.engine.runner.padding is None:  # one dynamic graph, compiled at start
        assert graphs() == compiled_at_start, "a request recompiled the step"
    else:  # a graph per padded shape: buckets up to 8 rows, contexts up to 4 multiples
        assert graphs() - compiled_at_start <= 2 * 4 * 4
    assert llm.engine.runner.compiled_steps > 20
    for prompt, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, PARAMS.max_tokens)
    llm.engine.check_integrity()
    return llm


def test_compiled_decode_equals_transformers(tiny_llama_dir: Path, hf_greedy: Ref) -> None:
    llm = run_compiled(tiny_llama_dir, 1, hf_greedy)
    assert llm.engine.runner.native_decode  # the CPU kernel, called from the compiled graph
    eager = LLM(
        str(tiny_llama_dir), dtype="float32", compile="off", block_size=8, num_kv_blocks=128
    )
    assert not eager.engine.runner.compiled
    batch = prompts(5)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS)] == [
        o.outputs[0].token_ids for o in eager.generate(batch, PARAMS)
    ]


def test_padded_static_shapes_equal_transformers(
    tiny_qwen2_dir: Path, hf_greedy: Ref, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-graph shape policy run on the cpu: rows padded to buckets with a scratch
    block, contexts padded to a multiple; padding must never reach a real block. Attention
    here is the portable compiled form (inductor's loops), not the CPU kernel, so that path
    is tested too."""
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", "0")
    padding = StepPadding(batch_buckets=(1, 2, 4, 8), context_multiple=32)
    monkeypatch.setattr(type(get_backend("cpu")), "step_padding", lambda self: padding)
    llm = run_compiled(tiny_qwen2_dir, 2, hf_greedy)
    runner = llm.engine.runner
    assert not runner.native_decode
    # Past the pool: the null block (masked positions read it), then the scratch block.
    assert runner.scratch_block == llm.engine.kv.pool.num_blocks + 1
    assert runner.kv_caches[0][0].shape[0] == llm.engine.kv.pool.num_blocks + 2


def test_auto_follows_the_backend_and_the_environment(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETERO_PD_COMPILE")
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, compile="off")
    assert llm.engine.config.compile_choice() == (False, "configured")
    auto = llm.engine.config.__class__(model="x", compile="auto")
    assert auto.compile_choice() == (None, "auto on cpu")  # the backend decides at load
    monkeypatch.setenv("HETERO_PD_COMPILE", "off")
    assert auto.compile_choice() == (False, "HETERO_PD_COMPILE")
    monkeypatch.setenv("HETERO_PD_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="HETERO_PD_COMPILE must be 'on' or 'off'"):
        auto.compile_choice()
    with pytest.raises(ValueError, match="compile must be one of"):
        llm.engine.config.__class__(model="x", compile="yes")


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_auto_asks_the_backend_whether_the_decode_kernel_runs(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """`compile: auto` is the backend's call once the engine knows whether its decode
    attention runs through the kernel (eager on CPU then: section 14 of BENCHMARKS)."""
    monkeypatch.delenv("HETERO_PD_COMPILE")
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", kernel)
    asked: list[bool] = []
    backend = type(get_backend("cpu"))

    def never(self: object, decode_kernel: bool) -> bool:
        asked.append(decode_kernel)
        return False  # not compiled here: these tests do not pay for a compile

    monkeypatch.setattr(backend, "compile_by_default", never)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16)
    assert asked == [llm.engine.runner.native_decode] == [kernel == "1"]
    assert not llm.engine.runner.compiled
    assert "decode step eager (auto on cpu)" in llm.engine.describe()


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_equal_transformers(tiny_llama_dir: Path, hf_greedy: Ref) -> None:
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", compile="on")
    assert llm.engine.runner.padding is not None
    batch = prompts(3)
    outs = llm.generate(batch, PARAMS)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, PARAMS.max_tokens)


def test_compiled_moe_decode_equals_transformers(
    tiny_qwen3_moe_dir: Path, hf_greedy: Ref, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MoE block is one opaque op (`hetero_pd::moe_experts`) inside the compiled layer:
    routing changes from step to step without recompiling (one graph per layer kind, MoE
    and dense), and tokens still equal transformers'. Threads stay fixed: a thread count
    the governor changes under load is a global state dynamo guards, and recompiles."""
    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "0")
    run_compiled(tiny_qwen3_moe_dir, 1, hf_greedy)


def test_compiled_mla_decode_equals_transformers(
    tiny_deepseek_v3_dir: Path, hf_greedy: Ref, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3 in the compiled step: the absorbed MLA decode over the latent cache
    (mla.py takes its decode path whenever it is compiled) and DeepSeek's routing around
    the opaque experts op; tokens equal transformers'."""
    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "0")
    llm = run_compiled(tiny_deepseek_v3_dir, 4, hf_greedy)
    assert not llm.engine.runner.native_decode  # MLA attends over latents, not K/V heads
