"""Batched prefill attention (models/attention.py `prefill_groups`): a step's prefill chunks
of one length, with or without a cached prefix, attend in one SDPA call, to the bit what a
call per chunk gives (to the bit but for an ulp in some
tiny float32 shapes), in float32 and bfloat16; and through the engine, a step mixing
lengths and cached prefixes gives transformers' greedy tokens (Llama and MLA)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from backends import paged_decode
from hetero_pd import LLM, SamplingParams, envs
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
# (cached prefix, chunk) per sequence, in the step's order: chunks of 5 apart (rows
# gathered), 4 and 4 back to back (a view), two chunks of 3 after the same 8 cached tokens
# (one masked call), one after 6, and a chunk alone.
SEQS = [(0, 5), (0, 7), (0, 5), (0, 4), (0, 4), (8, 3), (6, 3), (8, 3), (0, 2)]


def _step(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    tokens = sum(n for _, n in SEQS)
    q = torch.randn(tokens, HEADS, DIM, dtype=dtype)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(64, BLOCK, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
    return q, k, v, k_cache, v_cache


def _meta() -> AttentionMetadata:
    """Sequence i owns cache slots from 20 * i on: its prefix first, then its chunk."""
    slots, spans, row = [], [], 0
    for i, (prefix, n) in enumerate(SEQS):
        base = 20 * i
        slots += range(base + prefix, base + prefix + n)
        span = PrefillSpan(row, row + n)
        if prefix:
            span.context_slots = torch.arange(base, base + prefix + n)
            q_pos = torch.arange(prefix, prefix + n)
            span.mask = torch.arange(prefix + n)[None, :] <= q_pos[:, None]
        spans.append(span)
        row += n
    return AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=spans)


def _per_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """What paged_attention did before prefill_groups: one SDPA call per chunk."""
    out = torch.empty_like(q)
    k_flat, v_flat = k_cache.view(-1, KV_HEADS, DIM), v_cache.view(-1, KV_HEADS, DIM)
    for s in meta.prefills:
        qp = q[s.start : s.end].transpose(0, 1)[None]
        if s.context_slots is None:
            kp, vp = k[s.start : s.end], v[s.start : s.end]
        else:
            kp, vp = k_flat[s.context_slots], v_flat[s.context_slots]
        op = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1)[None],
            vp.transpose(0, 1)[None],
            attn_mask=s.mask,
            is_causal=s.mask is None,
            scale=DIM**-0.5,
            enable_gqa=True,
        )
        out[s.start : s.end] = op[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_a_call_per_chunk(dtype: torch.dtype) -> None:
    q, k, v, k_cache, v_cache = _step(dtype)
    meta = _meta()
    got = paged_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    # 9 chunks, 5 lengths-and-contexts: (5), (7), (4, 4), (3 after 8, twice), (3 after 6), (2)
    assert meta.groups is not None
    assert sorted(g.size for g in meta.groups) == [1, 1, 1, 2, 2, 2]
    assert [g.rows is None for g in meta.groups if g.size == 2] == [False, True, False]
    want = _per_chunk(q, k, v, k_cache, v_cache, meta)  # the cache now holds the step's K/V
    # Bit-equal, but for one ulp in float32's masked 3-token chunks: SDPA's kernel rounds
    # that shape by how it splits work over threads (as it does at one thread against two).
    ulp = torch.finfo(dtype).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_over_a_cached_prefix_through_the_kernel_equal_sdpa(dtype: torch.dtype) -> None:
    """With the kernel (`native_prefill` and `native_decode`), chunks after a cached prefix
    attend row by row through the decode kernel over the cache, the whole chunks through
    `prefill_causal`: within a rounding of SDPA per chunk (float32 to a few ulps, bfloat16 to
    its rtol; the kernel rounds bf16 weights as SDPA does, its exp differs in the last bits)."""
    kernels = envs.compile_cache_dir() / "kernels"
    if not paged_decode.available(dtype, kernels) or paged_decode.bf16_path() != "avx512_bf16":
        pytest.skip("the kernel's prefill runs only where the CPU has AVX-512 BF16")
    q, k, v, k_cache, v_cache = _step(dtype)
    meta = _meta()
    meta.native_prefill = meta.native_decode = True
    got = paged_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    assert meta.groups is not None
    assert [g.row_slots is not None for g in meta.groups] == [
        g.mask is not None for g in meta.groups
    ]
    want = _per_chunk(q, k, v, k_cache, v_cache, meta)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 1.6e-2}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_poisoned_prefix_leaves_the_other_chunks_of_its_kernel_call_alone(
    dtype: torch.dtype,
) -> None:
    """Two chunks after 8 cached tokens share one kernel call: one whose cached K/V and
    query a hostile client filled with NaN, inf and huge values changes no bit of the other
    chunk's rows (nor of any other chunk's), and the call does not fail."""
    kernels = envs.compile_cache_dir() / "kernels"
    if not paged_decode.available(dtype, kernels) or paged_decode.bf16_path() != "avx512_bf16":
        pytest.skip("the kernel's prefill runs only where the CPU has AVX-512 BF16")
    starts = [sum(n for _, n in SEQS[:i]) for i in range(len(SEQS))]
    bad = slice(starts[5], starts[5] + 3)  # sequence 5: 3 tokens after 8 cached (slots 100..)

    def run(poison: bool) -> torch.Tensor:
        q, k, v, k_cache, v_cache = _step(dtype)
        if poison:
            q[bad, :, ::3] = float("nan")
            k_cache.view(-1, KV_HEADS, DIM)[100:108, :, ::3] = float("inf")
            v_cache.view(-1, KV_HEADS, DIM)[100:108, :, ::3] = 3e38
        meta = _meta()
        meta.native_prefill = meta.native_decode = True
        return paged_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5)

    clean, got = run(False), run(True)
    others = torch.ones(clean.shape[0], dtype=torch.bool)
    others[bad] = False
    assert torch.equal(got[others], clean[others])
    assert not torch.equal(got[bad], clean[bad])  # the poison reached its own rows


Ref = Callable[..., list[int]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_deepseek_v3_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_of_equal_chunks_and_cached_prefixes_matches_transformers(
    model_fixture: str,
    dtype: torch.dtype,
    request: pytest.FixtureRequest,
    hf_greedy: Ref,
    half_greedy_check: Callable[..., int],
) -> None:
    path = request.getfixturevalue(model_fixture)
    llm = LLM(str(path), dtype=str(dtype)[6:], block_size=8, num_kv_blocks=128)
    rng = random.Random(5)
    shared, *tails = ([rng.randrange(512) for _ in range(n)] for n in (16, 6, 6, 6))
    fresh = [[rng.randrange(512) for _ in range(10)] for _ in range(3)]
    llm.generate([[*shared, 1]], GREEDY)  # caches the 16 shared tokens (two blocks)
    # One step: 10, 6 after the prefix, 10, 6 after the prefix, 9, 6 after the prefix.
    prompts = [fresh[0], shared + tails[0], fresh[1], shared + tails[1], fresh[2][:9]]
    prompts.append(shared + tails[2])
    reqs = [llm.engine.add_request(p, GREEDY) for p in prompts]
    outs = {}
    steps = 0
    while llm.engine.has_unfinished_requests():
        steps += 1
        for out in llm.engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [outs[r.request_id].num_cached_tokens for r in reqs] == [0, 16, 0, 16, 0, 16]
    assert steps == GREEDY.max_tokens, "the prompts were not prefilled in one step"
    for i, (prompt, req) in enumerate(zip(prompts, reqs, strict=True)):
        output = outs[req.request_id].outputs[0]
        if dtype == torch.float32:
            assert output.token_ids == hf_greedy(path, prompt, GREEDY.max_tokens), i
        else:
            half_greedy_check(path, prompt, output, dtype)
    llm.engine.check_integrity()
