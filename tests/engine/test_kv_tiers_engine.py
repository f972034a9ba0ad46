"""The engine with KV tiers on a working set larger than its device KV: greedy tokens equal
the engine without tiers and transformers, prefixes come back from host memory and the SSD
(also after a restart, and as misses when a file is damaged), and no block leaks. For K/V
heads (Llama) and MLA's latent blocks (DeepSeek-V3: one tensor a layer, no heads)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.kv_tiers import KVTierStats
from hetero_pd.models.config import ModelConfig

Ref = Callable[[Path, list[int], int], list[int]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BLOCK_SIZE = 8
# 24 x 8 tokens of device KV, float32 (4 bytes a value: the tiers below are sized in blocks)
DEVICE = dict(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_seqs=2)


def workload(seed: int = 0) -> list[list[int]]:
    """Six chats sharing a 64-token system prompt, 104 tokens each (13 blocks): about 50
    distinct blocks, twice what the device holds; asked three times over."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(64)]
    chats = [system + [rng.randrange(512) for _ in range(40)] for _ in range(6)]
    return chats * 3


def serve(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Two at a time, as turns arrive; returns the tokens and the prompt tokens cached."""
    tokens, cached = [], 0
    for i in range(0, len(prompts), 2):
        for out in llm.generate(prompts[i : i + 2], GREEDY):
            tokens.append(out.outputs[0].token_ids)
            cached += out.num_cached_tokens
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0, "blocks still held after every request ended"
    return tokens, cached


def tier_stats(llm: LLM) -> KVTierStats:
    stats = llm.engine.kv_tier_stats()
    assert stats is not None
    return stats


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_deepseek_v3_dir"])
def test_tiers_match_no_tiers_and_transformers(
    model_fixture: str, request: pytest.FixtureRequest, tmp_path: Path, hf_greedy: Ref
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    block_bytes = BLOCK_SIZE * ModelConfig.from_dir(model).kv_bytes_per_token * 4
    prompts = workload()
    off = LLM(str(model), **DEVICE)
    base, base_cached = serve(off, prompts)
    assert off.engine.kv_tier_stats() is None
    for prompt, got in zip(prompts[:6], base, strict=False):
        assert got == hf_greedy(model, prompt, GREEDY.max_tokens)
    dram = LLM(str(model), kv_cache_host_gb=0.01, **DEVICE)
    tokens, cached = serve(dram, prompts)
    assert tokens == base
    assert cached > base_cached, "host memory served prefixes the device had evicted"
    stats = tier_stats(dram)
    assert stats.host.hits > 0 and stats.disk is None
    dram.engine.close()
    # host memory for 20 blocks, the SSD for the rest
    ssd_opts = dict(kv_cache_host_gb=20 * block_bytes / 2**30, kv_cache_disk_gb=0.01)
    ssd = LLM(str(model), kv_cache_disk_path=str(tmp_path), **ssd_opts, **DEVICE)
    tokens, ssd_cached = serve(ssd, prompts)
    assert tokens == base
    stats = tier_stats(ssd)
    assert ssd_cached > base_cached and stats.disk is not None and stats.disk.hits > 0
    assert stats.host.stored_blocks <= 20
    ssd.engine.close()


def test_restart_reuses_the_ssd_and_damaged_files_are_misses(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    prompts = workload(seed=1)
    opts = dict(kv_cache_host_gb=0.01, kv_cache_disk_gb=0.01, kv_cache_disk_path=str(tmp_path))
    first = LLM(str(tiny_llama_dir), **opts, **DEVICE)
    base, _ = serve(first, prompts)
    first.engine.close()
    files = sorted(tmp_path.glob("*/*.kv"))
    assert files
    again = LLM(str(tiny_llama_dir), **opts, **DEVICE)  # a restarted worker
    tokens, cached = serve(again, prompts[:6])
    assert tokens == base[:6]
    assert cached > 0 and tier_stats(again).disk.hits > 0  # type: ignore[union-attr]
    again.engine.close()
    for i, path in enumerate(sorted(tmp_path.glob("*/*.kv"))):
        raw = bytearray(path.read_bytes())
        if i % 2:
            raw[-1] ^= 0xFF  # a flipped bit in the KV
        else:
            del raw[len(raw) // 2 :]  # a file cut short
        path.write_bytes(bytes(raw))
    damaged = LLM(str(tiny_llama_dir), **opts, **DEVICE)
    tokens, _ = serve(damaged, prompts[:6])
    assert tokens == base[:6], "damaged files were served as misses, never as KV"
    stats = tier_stats(damaged)
    assert stats.disk is not None and stats.disk.hits == 0
    damaged.engine.close()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs kv_cache_disk_path"):
        LLM("unused", kv_cache_host_gb=1, kv_cache_disk_gb=1)
    with pytest.raises(ValueError, match="needs kv_cache_host_gb > 0"):
        LLM("unused", kv_cache_disk_gb=1, kv_cache_disk_path="/tmp/x")
    with pytest.raises(ValueError, match="need enable_prefix_caching"):
        LLM("unused", kv_cache_host_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_cache_host_gb must be >= 0"):
        LLM("unused", kv_cache_host_gb=-1)
    with pytest.raises(ValueError, match="kv_cache_admit_after must be >= 1"):
        LLM("unused", kv_cache_host_gb=1, kv_cache_admit_after=0)
