"""An engine whose KV cache is in the NPU's fractal_nz layout (emulated on the CPU) gives
exactly the tokens of one in the standard nd layout: prefill, chunked prefill over a
cached prefix, decode batches of mixed lengths; and its blocks really are in fractal_nz."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends import get_backend, registered_kinds
from hetero_pd import LLM, SamplingParams
from hetero_pd.config import EngineConfig
from transfer.kv_layouts import FRACTAL_NZ, LAYOUTS, ND, nz_to_nd

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_each_backend_declares_a_known_layout() -> None:
    layouts = {kind: get_backend(kind).kv_layout for kind in registered_kinds()}
    assert set(layouts.values()) <= set(LAYOUTS)
    assert layouts["npu"] == FRACTAL_NZ and layouts["cpu"] == ND
    assert EngineConfig(model="m").kv_layout_choice() == ND
    assert EngineConfig(model="m", kv_layout=FRACTAL_NZ).kv_layout_choice() == FRACTAL_NZ
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        EngineConfig(model="m", kv_layout="nz")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fractal_nz_engine_matches_nd_and_transformers(
    tiny_llama_dir: Path, hf_greedy: Callable[..., list[int]], dtype: str
) -> None:
    rng = random.Random(4)
    shared = [rng.randrange(512) for _ in range(24)]
    prompts = [shared + [rng.randrange(512) for _ in range(n)] for n in (5, 30)]
    prompts += [[rng.randrange(512) for _ in range(n)] for n in (3, 41)]
    outs = {}
    for layout in (ND, FRACTAL_NZ):
        llm = LLM(
            str(tiny_llama_dir),
            dtype=dtype,
            block_size=8,
            num_kv_blocks=96,
            max_num_batched_tokens=32,  # the 71-token prompt is prefilled in chunks
            kv_layout=layout,
        )
        first = llm.generate(prompts[:1], PARAMS)  # its blocks are then a cached prefix
        outs[layout] = first + llm.generate(prompts[1:], PARAMS)
        llm.engine.check_integrity()
        if layout == FRACTAL_NZ:
            k0 = llm.engine.runner.kv_caches[0][0]
            assert llm.engine.runner.kv_layout == FRACTAL_NZ
            nz_runner = llm.engine.runner
        else:
            nd_cache = llm.engine.runner.kv_caches[0][0].clone()
    tokens = {lay: [o.outputs[0].token_ids for o in out] for lay, out in outs.items()}
    assert tokens[FRACTAL_NZ] == tokens[ND]
    # Same blocks were used in the same order: the nz cache is the nd one, rearranged.
    assert not torch.equal(k0, nd_cache) and torch.equal(nz_to_nd(k0), nd_cache)
    assert nz_runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    if dtype == "float32":  # bfloat16 chunked prefill rounds differently (test_dtype.py)
        for prompt, got in zip(prompts, tokens[ND], strict=True):
            assert got == hf_greedy(tiny_llama_dir, prompt, PARAMS.max_tokens)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_host_kv_cache_is_zero_and_takes_memory_only_as_written() -> None:
    """512 MiB of host KV: reads as zeros, and no page of it is resident before it is
    written (torch.zeros wrote every byte at start-up: ~1-2 s per GiB on one core, paid by
    every engine and every test that makes one, for blocks most never use)."""
    from hetero_pd.engine.model_runner import allocate_kv_tensors

    before = resident_bytes()
    kv = allocate_kv_tensors(2, 1024, (16, 2, 1024), torch.float32, torch.device("cpu"))
    assert len(kv) == 4 and all(t.shape == (1024, 16, 2, 1024) for t in kv)
    assert resident_bytes() - before < 32 * 2**20
    assert all(int(t[::97].count_nonzero()) == 0 for t in kv)
    kv[1][5].fill_(2.0)
    assert float(kv[1][5].sum()) == 2.0 * 16 * 2 * 1024 and int(kv[0][5].count_nonzero()) == 0
    assert resident_bytes() - before < 64 * 2**20
