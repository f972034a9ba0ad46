"""The CPU decode attention kernel (backends/paged_decode.py) against SDPA over a gathered
copy of the same cache (the eager path), its refusals, and its build when no compiler works."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from backends import get_backend, paged_decode
from hetero_pd import envs
from hetero_pd.models.attention import AttentionMetadata, paged_attention

BLOCK = 16


def cache_and_batch(
    dtype: torch.dtype, kv_heads: int, group: int, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """K/V caches [blocks, BLOCK, kv_heads, 64] and one decode token per sequence of `lens`
    cached tokens, each sequence's blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    dim, n = 64, len(lens)
    width = -(-max(lens) // BLOCK)
    num_blocks = 4 * n * width
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: n * width].view(n, width)
    ctx = width * BLOCK
    offsets = torch.arange(ctx)
    slots = tables[:, offsets // BLOCK] * BLOCK + offsets % BLOCK
    mask = offsets[None, :] < torch.tensor(lens)[:, None]
    q = torch.randn(n, kv_heads * group, dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode_tokens=n,
        decode_slots=slots.reshape(-1),
        decode_mask=mask[:, None, None, :],
    )
    return q, k, v, meta


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, native: bool
) -> torch.Tensor:
    meta.native_decode = native
    empty = q[:0, : k.shape[2]]
    meta.slot_mapping = torch.empty(0, dtype=torch.long)
    return paged_attention(q, empty, empty, k, v, meta, q.shape[-1] ** -0.5)


KERNELS = envs.cache_dir() / "kernels"  # where engines keep it
needs_kernel = pytest.mark.skipif(
    not paged_decode.available(torch.float32, KERNELS),
    reason="no C compiler could build the kernel",
)


@needs_kernel
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
def test_float32_equals_sdpa_over_a_gathered_copy(kv_heads: int, group: int) -> None:
    q, k, v, meta = cache_and_batch(torch.float32, kv_heads, group, [1, 17, 64, 130, 5])
    got = attend(q, k, v, meta, native=True)
    want = attend(q, k, v, meta, native=False)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_bfloat16_stays_on_the_portable_path() -> None:
    """SDPA rounds the softmax to bfloat16 before multiplying by V (transformers too), which
    the kernel does not copy: greedy tokens in bfloat16 would drift from transformers'."""
    assert not paged_decode.available(torch.bfloat16, KERNELS)
    assert not paged_decode.available(torch.float16, KERNELS)


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_not_read() -> None:
    q, k, v, meta = cache_and_batch(torch.float32, 3, 3, [20, 20])
    assert meta.decode_slots is not None
    meta.decode_slots[5] = k.shape[0] * BLOCK  # one past the last slot
    with pytest.raises(RuntimeError, match="slot lies outside the KV cache"):
        attend(q, k, v, meta, native=True)
    meta.decode_slots[5] = -1
    with pytest.raises(RuntimeError, match="slot lies outside the KV cache"):
        attend(q, k, v, meta, native=True)
    assert meta.decode_mask is not None
    meta.decode_mask.view(-1)[5] = False  # a masked position is never read: no refusal
    got = attend(q, k, v, meta, native=True)
    meta.decode_slots[5] = 0  # SDPA over a gathered copy reads every slot, masked or not
    torch.testing.assert_close(got, attend(q, k, v, meta, native=False))


@needs_kernel
def test_sizes_the_kernel_would_read_past_are_refused() -> None:
    q, k, v, meta = cache_and_batch(torch.float32, 3, 3, [20, 20])
    slots, mask = meta.decode_slots, meta.decode_mask
    assert slots is not None and mask is not None
    flat = (k.view(-1, 3, 64), v.view(-1, 3, 64))
    mask = mask.reshape(-1)
    op = paged_decode.paged_decode
    cases = {
        "of dim 32": (q, torch.zeros(64, 3, 32), torch.zeros(64, 3, 32)),
        "one shape": (q, k, v),  # the 4-D cache, not its slot rows
        "cannot share 2 KV heads": (q, k.view(-1, 2, 96), v.view(-1, 2, 96)),
        "at most 256": (torch.randn(2, 258, 64), *(t.view(-1, 3, 64) for t in (k, v))),
    }
    for message, (qq, kk, vv) in cases.items():
        with pytest.raises(ValueError, match=message):
            op(qq, kk, vv, slots, mask, 0.125)
    with pytest.raises(ValueError, match="must be on the cpu, got"):
        # A meta tensor reaches the op's fake; a device tensor would reach this check.
        paged_decode._check(q.to("meta"), *flat, slots, mask)
    with pytest.raises(ValueError, match="slots int64 and mask bool"):
        op(q, *flat, slots.int(), mask, 0.125)
    with pytest.raises(ValueError, match="n x ctx entries"):
        op(q, *flat, slots[:-1], mask[:-1], 0.125)


@needs_kernel
def test_edges_empty_batches_masked_rows_views_and_thread_counts() -> None:
    q, k, v, meta = cache_and_batch(torch.float32, 3, 3, [30, 1, 77])
    slots, mask = meta.decode_slots, meta.decode_mask
    assert slots is not None and mask is not None
    flat = (k.view(-1, 3, 64), v.view(-1, 3, 64))
    op = paged_decode.paged_decode
    assert op(q[:0], *flat, slots[:0], mask.reshape(-1)[:0], 0.125).shape == (0, 9, 64)
    none = mask.clone()
    none[1] = False  # a row attending to nothing gives zeros, not NaN
    out = op(q, *flat, slots, none.reshape(-1), 0.125)
    assert out[1].eq(0).all() and out.isfinite().all()
    wide = torch.randn(3, 64, 9).transpose(1, 2)  # q as a strided view, as the model makes it
    want = op(wide.contiguous(), *flat, slots, mask.reshape(-1), 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(wide, *flat, slots, mask.reshape(-1), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, want)  # each sequence is one task: no thread changes its sums


@needs_kernel
def test_the_engine_uses_it_unless_told_not_to(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 engines: the kernel takes float32 only (bfloat16 keeps the portable path)."""
    from hetero_pd import LLM

    assert get_backend("cpu").native_decode_attention(torch.float32, KERNELS)
    assert not get_backend("cpu").native_decode_attention(torch.bfloat16, KERNELS)
    fp32 = {"dtype": "float32", "num_kv_blocks": 16}
    assert LLM(str(tiny_llama_dir), **fp32).engine.runner.native_decode
    assert not LLM(
        str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=16
    ).engine.runner.native_decode
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", "0")
    assert not LLM(str(tiny_llama_dir), **fp32).engine.runner.native_decode


def test_no_working_compiler_means_the_portable_path_and_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    paged_decode._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="backends.paged_decode"):
            assert not paged_decode.available(torch.float32, tmp_path / "kernels")
        assert "building the decode attention kernel in" in caplog.text
        assert "runs portable" in caplog.text
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library
    finally:
        paged_decode._library.cache_clear()


@needs_kernel
def test_a_kernel_others_could_write_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading a library runs its code: in a cache folder another user (or a pod sharing the
    volume) could write, or from a file not ours, the kernel is refused, not loaded."""
    kernels = tmp_path / "kernels"
    paged_decode._library.cache_clear()
    try:
        assert paged_decode._library(kernels) is not None  # built here, private
        kernels.chmod(0o777)
        paged_decode._library.cache_clear()
        with caplog.at_level(logging.WARNING, logger="backends.paged_decode"):
            assert paged_decode._library(kernels) is None
        assert "mode 777: only uid" in caplog.text
        kernels.chmod(0o700)
        if os.getuid() == 0:  # a library another user planted, in our folder
            os.chown(next(kernels.glob("*.so")), 65534, 65534)
            paged_decode._library.cache_clear()
            assert paged_decode._library(kernels) is None
            assert "owned by uid 65534" in caplog.text
    finally:
        paged_decode._library.cache_clear()
