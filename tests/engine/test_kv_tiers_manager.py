"""The KV cache manager with host and SSD tiers, on KV tensors written by the test (no
model): admission after two sightings, blocks brought back bit-exactly before a request
runs, a warm restart from the SSD, corrupted files as misses, and no leaked block."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetero_pd.engine.kv_cache_manager import KVCacheManager, prompt_block_hashes
from hetero_pd.engine.kv_tiers import TierConfig, build_kv_tiers
from hetero_pd.engine.kv_tiers.blockfile import HEADER_SIZE
from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import Scheduler, SchedulerConfig
from hetero_pd.sampling_params import SamplingParams

BS, LAYERS, SHAPE = 4, 2, (2, 8)  # block size, layers, (kv heads, head dim)
PARAMS = SamplingParams(max_tokens=1)


class Setup:
    """A manager over KV tensors in `dtype`, with `host_slots` host blocks and an SSD tier
    of `disk_files` blocks under `disk` (none when 0)."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        num_blocks: int,
        host_slots: int,
        disk: Path | None = None,
        disk_files: int = 0,
        admit_after: int = 2,
    ) -> None:
        self.dtype = dtype
        self.kv = [torch.zeros(num_blocks, BS, *SHAPE, dtype=dtype) for _ in range(2 * LAYERS)]
        self.block_bytes = 2 * LAYERS * BS * SHAPE[0] * SHAPE[1] * self.kv[0].element_size()
        disk_bytes = disk_files * (HEADER_SIZE + self.block_bytes)
        config = TierConfig(host_slots * self.block_bytes, disk_bytes, disk, admit_after)
        tiers = build_kv_tiers(config, model_dir, self.kv)
        self.m = KVCacheManager(num_blocks, BS, True, tiers)
        self.n = 0

    def expected(self, block_hash: int) -> torch.Tensor:
        """What 'the model' writes for a block: a function of its whole prefix."""
        gen = torch.Generator().manual_seed(block_hash % 2**63)
        return torch.randn(2 * LAYERS, BS, *SHAPE, generator=gen).to(self.dtype)

    def run(self, prompt: list[int]) -> int:
        """Admits, 'computes' and frees one request; checks every cached block's KV bit by
        bit and returns the number of prompt tokens served from the cache."""
        self.n += 1
        req = Request(f"r{self.n}", prompt, PARAMS)
        cached = self.m.find_cached_prefix(req)
        for _ in range(1000):
            if cached is not None:
                break
            self.m.begin_step(idle=True)  # the request waits until its prefix has landed
            cached = self.m.find_cached_prefix(req)
        assert cached is not None, "the onload never landed"
        assert self.m.allocate_new(req, cached, len(prompt) - len(cached) * BS)
        hashes = prompt_block_hashes(prompt, BS)
        for i, block_id in enumerate(req.block_ids[: len(hashes)]):
            data = self.expected(hashes[i])
            if i < len(cached):
                got = torch.stack([t[block_id] for t in self.kv])
                assert torch.equal(got.view(torch.uint8), data.view(torch.uint8)), i
            else:
                for t, d in zip(self.kv, data, strict=True):
                    t[block_id] = d
        req.num_computed_tokens = len(prompt)
        self.m.cache_computed_blocks(req)
        self.m.free(req)
        return req.num_cached_tokens

    def settle(self) -> None:
        self.m.drain_tiers()
        self.m.check_integrity()
        assert self.m.pool.counts()[2] == 0, "blocks still held"


def prompt(seed: int, blocks: int = 5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (blocks * BS + 1,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_seen_twice_go_to_host_and_come_back_bit_exact(
    tiny_llama_dir: Path, dtype: torch.dtype
) -> None:
    s = Setup(tiny_llama_dir, dtype, num_blocks=8, host_slots=16)
    a, b, c = prompt(1), prompt(2), prompt(3)
    assert s.run(a) == 0
    s.settle()
    assert s.m.tier_stats().host.writes == 0, "seen once: not admitted"
    assert s.run(a) == 5 * BS  # a device hit: seen twice, copied down when freed
    s.settle()
    assert s.m.tier_stats().host.writes == 5
    for p in (b, c):  # evict a from the device
        s.run(p)
        s.settle()
    assert s.run(a) == 5 * BS, "a came back from host memory"
    s.settle()
    stats = s.m.tier_stats()
    assert stats.host.hits == 5 and stats.onloads == 1 and stats.onload_blocks == 5
    assert stats.host.hit_bytes == 5 * s.block_bytes
    assert stats.onload_seconds_total > 0
    s.m.close()


def test_admit_after_one_copies_every_cached_block_down(tiny_llama_dir: Path) -> None:
    s = Setup(tiny_llama_dir, torch.float32, num_blocks=8, host_slots=16, admit_after=1)
    a = prompt(1)
    s.run(a)
    s.settle()
    assert s.m.tier_stats().host.writes == 5
    for p in (prompt(2), prompt(3)):
        s.run(p)
        s.settle()
    assert s.run(a) == 5 * BS and s.m.tier_stats().host.hits == 5
    s.m.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_restart_serves_from_the_ssd_and_a_damaged_file_is_a_miss(
    tiny_llama_dir: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    s = Setup(tiny_llama_dir, dtype, num_blocks=8, host_slots=16, disk=tmp_path, disk_files=64)
    a, b = prompt(1), prompt(2)
    for p in (a, a, b, b):
        s.run(p)
        s.settle()
    assert s.m.tier_stats().disk.writes == 10  # write-through of what the host took
    s.m.close()
    # a new engine on the same folder: empty device and host, the SSD index rebuilt
    s = Setup(tiny_llama_dir, dtype, num_blocks=8, host_slots=16, disk=tmp_path, disk_files=64)
    assert s.run(a) == 5 * BS
    s.settle()
    assert s.m.tier_stats().disk.hits == 5
    s.m.close()
    s = Setup(tiny_llama_dir, dtype, num_blocks=8, host_slots=16, disk=tmp_path, disk_files=64)
    files = {int(p.stem, 16): p for p in tmp_path.glob("*/*.kv")}
    hashes = prompt_block_hashes(b, BS)
    with files[hashes[2]].open("r+b") as f:  # flip one payload bit of b's third block
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    os.truncate(files[hashes[4]], 100)  # and cut its fifth short
    assert s.run(b) == 2 * BS, "blocks from the damaged one on are computed, not loaded"
    s.settle()
    stats = s.m.tier_stats()
    assert stats.disk_corrupt == 1 and stats.disk.hits == 2
    assert not files[hashes[2]].exists()
    s.m.close()


def test_another_models_ssd_files_are_never_used(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    s = Setup(tiny_llama_dir, torch.float32, 8, 16, tmp_path, 64)
    for p in (prompt(1), prompt(1)):
        s.run(p)
    s.settle()
    s.m.close()
    s = Setup(tiny_qwen2_dir, torch.float32, 8, 16, tmp_path, 64)
    assert s.run(prompt(1)) == 0
    s.settle()
    s.m.close()
    s = Setup(tiny_llama_dir, torch.bfloat16, 8, 16, tmp_path, 64)
    assert s.run(prompt(1)) == 0, "same model, other dtype: other files"
    s.settle()
    s.m.close()


def test_sizes_are_bounded(tiny_llama_dir: Path, tmp_path: Path) -> None:
    s = Setup(tiny_llama_dir, torch.float32, 8, host_slots=6, disk=tmp_path, disk_files=9)
    for seed in range(6):
        for _ in range(2):
            s.run(prompt(seed))
            s.settle()
    stats = s.m.tier_stats()
    assert stats.host.stored_blocks <= 6 and stats.host.evictions > 0
    assert stats.host.stored_bytes <= stats.host.capacity_bytes == 6 * s.block_bytes
    assert stats.disk.stored_blocks <= 9 and stats.disk.evictions > 0
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) == stats.disk.stored_blocks
    assert sum(f.stat().st_size for f in files) <= stats.disk.capacity_bytes
    s.m.close()


def test_a_request_aborted_while_its_prefix_loads_leaks_nothing(tiny_llama_dir: Path) -> None:
    s = Setup(tiny_llama_dir, torch.float32, num_blocks=8, host_slots=16)
    a = prompt(1)
    for p in (a, a, prompt(2), prompt(3)):
        s.run(p)
        s.settle()
    req = Request("aborted", a, PARAMS)
    assert s.m.find_cached_prefix(req) is None, "its prefix is in host memory: loading"
    assert s.m.find_cached_prefix(req) is None, "still loading: never scheduled half-loaded"
    s.m.free(req)  # aborted
    s.settle()  # the load lands and its blocks are cached on the device
    assert s.run(a) == 5 * BS
    s.settle()
    assert s.m.tier_stats().onloads == 1
    s.m.close()


def test_the_scheduler_runs_others_while_a_prefix_loads(tiny_llama_dir: Path) -> None:
    s = Setup(tiny_llama_dir, torch.float32, num_blocks=16, host_slots=16)
    a = prompt(1)
    for p in (a, a, prompt(2), prompt(3), prompt(5)):  # a leaves the device
        s.run(p)
        s.settle()
    sched = Scheduler(SchedulerConfig(max_model_len=256), s.m)
    loading, other = Request("loading", a, PARAMS), Request("other", prompt(4), PARAMS)
    sched.add_request(loading)
    sched.add_request(other)
    out = sched.schedule()
    assert [c.request for c in out.chunks] == [other], "the loading request is skipped"
    sched.update(out, {})
    assert s.m.tiers is not None
    s.m.tiers.wait_done(timeout=60, all_jobs=True)  # the copy thread lands the prefix
    out = sched.schedule()
    chunk = next(c for c in out.chunks if c.request is loading)
    assert loading.num_computed_tokens == loading.num_cached_tokens == 5 * BS
    assert chunk.num_tokens == 1, "only the last prompt token is computed"
    hashes = prompt_block_hashes(a, BS)
    for i, block_id in enumerate(loading.block_ids[:5]):
        got = torch.stack([t[block_id] for t in s.kv])
        assert torch.equal(got, s.expected(hashes[i])), "scheduled on fully landed KV"
    sched.abort("loading")
    sched.abort("other")
    s.settle()
    s.m.close()
