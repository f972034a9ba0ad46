"""The CPU decode attention kernel (backends/paged_decode.py) against SDPA over a gathered
copy of the same cache (the eager path), in float32 and in bfloat16 on each of its bf16
paths, its refusals, and its build when no compiler works."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from backends import get_backend, paged_decode
from backends.cpuinfo import cpu_flags
from hetero_pd import envs
from hetero_pd.models.attention import AttentionMetadata, paged_attention

BLOCK = 16


def cache_and_batch(
    dtype: torch.dtype,
    kv_heads: int,
    group: int,
    lens: list[int],
    seed: int = 0,
    block: int = BLOCK,
    dim: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """K/V caches [blocks, block, kv_heads, dim] and one decode token per sequence of `lens`
    cached tokens, each sequence's blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lens)
    width = -(-max(lens) // block)
    num_blocks = 4 * n * width
    k = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: n * width].view(n, width)
    ctx = width * block
    offsets = torch.arange(ctx)
    slots = tables[:, offsets // block] * block + offsets % block
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


def kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, portable: bool
) -> torch.Tensor:
    """The kernel's float32 output on one path, as the compiled step calls it."""
    assert meta.decode_slots is not None and meta.decode_mask is not None
    flat = (k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]))
    mask = meta.decode_mask.reshape(-1)
    return paged_decode.paged_decode(
        q, *flat, meta.decode_slots, mask, q.shape[-1] ** -0.5, portable=portable
    )


KERNELS = envs.compile_cache_dir() / "kernels"  # where engines keep it
needs_kernel = pytest.mark.skipif(
    not paged_decode.available(torch.float32, KERNELS),
    reason="no C compiler could build the kernel",
)


#: (context lengths, block size, head dim): past SDPA's 512-token KV split, blocks of 1 to 32
#: slots, head dims that leave the AVX-512 loops a masked tail (72 = 2 x 32 + 8), and the
#: blocked AVX-512 path's two (64 and 128; a length of exactly one 16-position block).
SHAPES = [
    ([1, 17, 64, 130, 5], 16, 64),
    ([700, 3, 513], 32, 64),
    ([40, 9], 1, 72),
    ([33, 300, 16], 16, 128),
]
#: The kernel's paths: the portable one runs everywhere, AVX-512 BF16 where the CPU has it
#: (float32 takes its blocked loops too).
KERNEL_PATHS = [
    pytest.param(True, id="portable"),
    pytest.param(
        False,
        id="avx512_bf16",
        marks=pytest.mark.skipif(
            "avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX-512 BF16"
        ),
    ),
]


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("lens,block,dim", SHAPES)
def test_float32_equals_sdpa_over_a_gathered_copy(
    portable: bool, kv_heads: int, group: int, lens: list[int], block: int, dim: int
) -> None:
    q, k, v, meta = cache_and_batch(torch.float32, kv_heads, group, lens, block=block, dim=dim)
    got = kernel(q, k, v, meta, portable)
    want = attend(q, k, v, meta, native=False)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(attend(q, k, v, meta, native=True), kernel(q, k, v, meta, False))


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("lens,block,dim", SHAPES)
def test_bfloat16_equals_sdpa_within_a_rounding(
    portable: bool, kv_heads: int, group: int, lens: list[int], block: int, dim: int
) -> None:
    """bfloat16 q/K/V read from the cache, accumulated in float32: against SDPA in bfloat16
    (transformers' reference) to bfloat16's rtol 1.6e-2 and atol 2e-3 (outputs are ~0.1-1;
    SDPA's own exp rounds some weights the other way, which moves outputs near 0 by ~2e-4),
    and against float32 attention over the same bf16 values with the weights rounded to
    bf16 as SDPA does, to 1e-5 + 2e-3 relative (a weight's rounding can flip where float32
    sums in another order)."""
    q, k, v, meta = cache_and_batch(torch.bfloat16, kv_heads, group, lens, block=block, dim=dim)
    assert paged_decode.bf16_path(portable) == ("portable" if portable else "avx512_bf16")
    got = kernel(q, k, v, meta, portable)
    assert got.dtype == torch.float32
    sdpa = attend(q, k, v, meta, native=False)
    torch.testing.assert_close(got.bfloat16(), sdpa, atol=2e-3, rtol=1.6e-2)
    torch.testing.assert_close(got, reference(q, k, v, meta), atol=1e-5, rtol=2e-3)
    fastest = kernel(q, k, v, meta, portable=False).bfloat16()  # the engine's eager path's
    assert torch.equal(attend(q, k, v, meta, native=True), fastest)


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
def test_a_bfloat16_output_is_the_float32_one_rounded(portable: bool) -> None:
    """`bf16_out` rounds in the kernel (the engine's bf16 steps take it: no float32 output
    for a separate cast loop): the same bits as casting the float32 output; float32 K/V
    cannot ask for it."""
    q, k, v, meta = cache_and_batch(torch.bfloat16, 2, 3, [1, 17, 64, 130, 5])
    assert meta.decode_slots is not None and meta.decode_mask is not None
    args = (q, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]), meta.decode_slots)
    mask = meta.decode_mask.reshape(-1)
    got = paged_decode.decode(*args, mask, 0.125, portable=portable, bf16_out=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, paged_decode.decode(*args, mask, 0.125, portable=portable).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 output needs bfloat16 K/V"):
        paged_decode.decode(*(t.float() for t in args[:3]), args[3], mask, 0.1, bf16_out=True)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """float32 attention over bf16 values, the softmax's weights rounded to bf16 (not their
    sum) before they multiply V."""
    assert meta.decode_slots is not None and meta.decode_mask is not None
    n, heads, dim = q.shape
    kv_heads = k.shape[2]
    kd = k.view(-1, kv_heads, dim)[meta.decode_slots].view(n, -1, kv_heads, dim).float()
    vd = v.view(-1, kv_heads, dim)[meta.decode_slots].view(n, -1, kv_heads, dim).float()
    kd, vd = (t.transpose(1, 2).repeat_interleave(heads // kv_heads, 1) for t in (kd, vd))
    scores = (q.float().unsqueeze(2) @ kd.transpose(-1, -2)) * dim**-0.5  # [n, heads, 1, ctx]
    scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    return ((e.bfloat16().float() @ vd) / e.sum(-1, keepdim=True)).view(n, heads, dim)


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
@pytest.mark.parametrize(
    "size,tokens,kv_heads,group,dim",
    [(8, 37, 3, 3, 64), (1, 300, 3, 3, 64), (2, 16, 2, 1, 128), (3, 5, 1, 8, 72)],
)
def test_causal_prefill_equals_sdpa_within_a_rounding(
    portable: bool, size: int, tokens: int, kv_heads: int, group: int, dim: int
) -> None:
    """Chunks of equal length attended causally, each row as a decode query over the rows
    before it: against float32 attention over the same values, the weights rounded to bf16,
    to the output's own rounding; and against SDPA with is_causal over each chunk in
    bfloat16 (what transformers and the eager prefill otherwise run) to bfloat16's rtol and
    4e-3 absolute: SDPA's own exp rounds some weights the other way (6,221 of 170,496 of its
    outputs differ from that reference's rounding here, 1 of the kernel's), and in a row of
    a few positions one weight's rounding moves an output by up to ~3e-3."""
    gen = torch.Generator().manual_seed(size * tokens + dim)
    rows, heads = size * tokens, kv_heads * group
    q = torch.randn(rows, heads, dim, generator=gen).bfloat16()
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    got = paged_decode.prefill_causal(q, k, v, tokens, dim**-0.5, portable=portable)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [size, heads, tokens, dim]
        return t.view(size, tokens, -1, dim).transpose(1, 2)

    sdpa = torch.nn.functional.scaled_dot_product_attention(
        chunks(q), chunks(k), chunks(v), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(got, sdpa.transpose(1, 2).reshape(q.shape), atol=4e-3, rtol=1.6e-2)
    kf, vf = (chunks(t).float().repeat_interleave(group, 1) for t in (k, v))
    scores = (chunks(q).float() @ kf.transpose(-1, -2)) * dim**-0.5
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    want = (e.bfloat16().float() @ vf) / e.sum(-1, keepdim=True)
    torch.testing.assert_close(
        got.float(), want.transpose(1, 2).reshape(q.shape), atol=1e-4, rtol=8e-3
    )


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
@pytest.mark.parametrize("size,tokens,kv_heads,group,dim", [(8, 37, 3, 3, 64), (2, 16, 2, 1, 128)])
def test_causal_prefill_in_float32_equals_sdpa(
    portable: bool, size: int, tokens: int, kv_heads: int, group: int, dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    rows, heads = size * tokens, kv_heads * group
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen) for _ in range(2))
    got = paged_decode.prefill_causal(q, k, v, tokens, dim**-0.5, portable=portable)
    assert got.dtype == torch.float32

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.view(size, tokens, -1, dim).transpose(1, 2)

    sdpa = torch.nn.functional.scaled_dot_product_attention(
        chunks(q), chunks(k), chunks(v), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(got, sdpa.transpose(1, 2).reshape(q.shape), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("portable", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_poisoned_chunk_leaves_the_others_in_its_call_alone(
    portable: bool, dtype: torch.dtype
) -> None:
    """Chunks of several requests share one call (prefill_groups): one whose q, K and V a
    hostile client filled with NaN, inf and huge values (an edge session's hidden states,
    say) changes no bit of the others' outputs, and the call does not fail."""
    gen = torch.Generator().manual_seed(7)
    size, tokens, heads, kv_heads, dim = 4, 40, 9, 3, 64
    q = torch.randn(size * tokens, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(size * tokens, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    clean = paged_decode.prefill_causal(q, k, v, tokens, dim**-0.5, portable=portable)
    bad = slice(tokens, 2 * tokens)  # the second chunk
    for t, value in ((q, float("nan")), (k, float("inf")), (v, 3e38)):
        t[bad, :, ::3] = value
    got = paged_decode.prefill_causal(q, k, v, tokens, dim**-0.5, portable=portable)
    others = torch.ones(size * tokens, dtype=torch.bool)
    others[bad] = False
    assert torch.equal(got[others], clean[others])


@needs_kernel
def test_causal_prefill_refuses_what_it_cannot_read() -> None:
    q = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(6, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="of one of"):
        paged_decode.prefill_causal(q.float(), kv, kv, 3, 1.0)
    with pytest.raises(ValueError, match="of one of"):
        paged_decode.prefill_causal(q.half(), kv.half(), kv.half(), 3, 1.0)
    with pytest.raises(ValueError, match="of its rows and dim"):
        paged_decode.prefill_causal(q, kv[:5], kv[:5], 3, 1.0)
    with pytest.raises(ValueError, match="cannot share 3 KV heads"):
        paged_decode.prefill_causal(q, q[:, :3], q[:, :3], 3, 1.0)
    with pytest.raises(ValueError, match="6 rows are not chunks of 4 tokens"):
        paged_decode.prefill_causal(q, kv, kv, 4, 1.0)


@needs_kernel
def test_float16_stays_on_the_portable_path() -> None:
    assert paged_decode.available(torch.bfloat16, KERNELS)
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
    """float32 and bfloat16 engines take the kernel for decode, and for causal prefill where
    its AVX-512 loops run (in the NPU's KV layout too: prefill reads no cache); float16
    keeps the portable path."""
    from hetero_pd import LLM

    cpu = get_backend("cpu")
    assert cpu.native_decode_attention(torch.float32, KERNELS)
    assert cpu.native_decode_attention(torch.bfloat16, KERNELS)
    assert not cpu.native_decode_attention(torch.float16, KERNELS)
    fast = paged_decode.bf16_path() == "avx512_bf16"
    for dtype in ("float32", "bfloat16"):
        runner = LLM(str(tiny_llama_dir), dtype=dtype, num_kv_blocks=16).engine.runner
        assert runner.native_decode and runner.native_prefill == fast
    nz = {"dtype": "bfloat16", "num_kv_blocks": 16, "kv_layout": "fractal_nz"}
    runner = LLM(str(tiny_llama_dir), **nz).engine.runner
    assert not runner.native_decode and runner.native_prefill == fast
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", "0")
    runner = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16).engine.runner
    assert not runner.native_decode and not runner.native_prefill


def test_no_working_compiler_means_the_portable_path_and_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    paged_decode._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="backends.native"):
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
        with caplog.at_level(logging.WARNING, logger="backends.native"):
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


@needs_kernel
def test_a_kernel_built_in_a_folder_others_could_write_is_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only cached kernels were checked: one built just now in a folder others may write
    was loaded, though they could have swapped it between the build and the load."""
    kernels = tmp_path / "open"
    kernels.mkdir()
    kernels.chmod(0o777)
    paged_decode._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="backends.native"):
            assert paged_decode._library(kernels) is None
        assert "mode 777: only uid" in caplog.text
    finally:
        paged_decode._library.cache_clear()
