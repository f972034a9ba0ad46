"""The CPU RMSNorm kernel (backends/rms_norm.py) against transformers' LlamaRMSNorm formula,
in bfloat16 on each of its paths and in float32; the fused residual add; its refusals; and
an engine taking it (or not, by HETERO_PD_NATIVE_NORM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import get_backend, rms_norm
from backends.cpuinfo import cpu_flags
from hetero_pd import LLM, envs
from hetero_pd.models.llama import RMSNorm
from tests.backends.test_paged_decode import KERNEL_PATHS as PATHS

KERNELS = envs.compile_cache_dir() / "kernels"  # where engines keep it
pytestmark = pytest.mark.skipif(
    not rms_norm.available(torch.bfloat16, KERNELS), reason="no C compiler could build the kernel"
)
EPS = 1e-5
#: (rows, dim): SmolLM2's hidden size, a head dim, tails the 16-lane loops leave, and
#: enough rows x dim (>= 2^16) for the kernel's parallel loop.
SHAPES = [(37, 576), (5, 64), (9, 100), (4, 3), (160, 576)]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + EPS)
    return weight * xf.to(x.dtype)


def rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=gen) * 8  # rows of different magnitudes
    return (torch.randn(n, dim, generator=gen) * scale).to(dtype)


def assert_near_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, but where the sum of squares' order moved rsqrt by an ulp and a rounding to
    bf16 went the other way: then by one bf16 step (2^-7 relative after two roundings),
    in at most 1 element in 200."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7).all(), diff.max()
    assert (got != want).float().mean() <= 1 / 200


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("n,dim", SHAPES)
def test_bfloat16_equals_the_reference_formula(portable: bool, n: int, dim: int) -> None:
    x, w = rows(n, dim, torch.bfloat16, 0), rows(1, dim, torch.bfloat16, 1)[0]
    assert rms_norm.bf16_path(portable) == ("portable" if portable else "avx512_bf16")
    assert_near_bf16(rms_norm.rms_norm(x, w, EPS, portable), reference(x, w))
    strided = torch.cat([x, x], dim=1)[:, dim:]  # rows apart by 2 x dim
    assert_near_bf16(rms_norm.rms_norm(strided, w, EPS, portable), reference(x, w))


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("n,dim", SHAPES)
def test_the_fused_add_rounds_the_sum_first(portable: bool, n: int, dim: int) -> None:
    """vLLM's fused_add_rms_norm: the sum, rounded to bf16 as `a.add_(res)` rounds it, is
    what is normalised, and it comes back bit for bit."""
    a, res = rows(n, dim, torch.bfloat16, 2), rows(n, dim, torch.bfloat16, 3)
    w = rows(1, dim, torch.bfloat16, 4)[0]
    out, total = rms_norm.add_rms_norm(a, res, w, EPS, portable)
    assert torch.equal(total, a + res)
    assert_near_bf16(out, reference(a + res, w))


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX-512 BF16")
def test_both_paths_give_the_same_bits() -> None:
    x, w = rows(64, 576, torch.bfloat16, 5), rows(1, 576, torch.bfloat16, 6)[0]
    res = rows(64, 576, torch.bfloat16, 7)
    assert torch.equal(rms_norm.rms_norm(x, w, EPS, True), rms_norm.rms_norm(x, w, EPS, False))
    fast, slow = rms_norm.add_rms_norm(x, res, w, EPS), rms_norm.add_rms_norm(x, res, w, EPS, True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@pytest.mark.parametrize("n,dim", SHAPES)
def test_float32_within_an_ulp_of_the_reference(n: int, dim: int) -> None:
    x, w = rows(n, dim, torch.float32, 8), rows(1, dim, torch.float32, 9)[0]
    torch.testing.assert_close(rms_norm.rms_norm(x, w, EPS), reference(x, w), rtol=5e-7, atol=0)
    res = rows(n, dim, torch.float32, 10)
    out, total = rms_norm.add_rms_norm(x, res, w, EPS)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(out, reference(x + res, w), rtol=5e-7, atol=0)


def test_bad_inputs_are_named() -> None:
    x, w = rows(4, 64, torch.bfloat16, 0), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight \[64\]"):
        rms_norm.rms_norm(x, w.float(), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm.add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="float16"):
        rms_norm.rms_norm(x.half(), w.half(), EPS)


@torch.inference_mode()  # as engines run
def test_the_module_and_the_compiled_op_agree_with_torch() -> None:
    """RMSNorm's native path, eager and inside a compiled graph, against its torch path."""
    norm = RMSNorm(576, EPS).to(torch.bfloat16)
    norm.weight.data = rows(1, 576, torch.bfloat16, 11)[0]
    x, res = rows(8, 576, torch.bfloat16, 12), rows(8, 576, torch.bfloat16, 13)
    want = norm(x), norm.add(x.clone(), res)
    norm.native = True
    compiled = torch.compile(lambda a, r: (norm(a), norm.add(a, r)), backend="inductor")
    for got in ((norm(x), norm.add(x.clone(), res)), compiled(x, res)):
        assert_near_bf16(got[0], want[0])
        assert_near_bf16(got[1][0], want[1][0])
        assert torch.equal(got[1][1], want[1][1])


def test_engines_take_it_unless_told_not_to(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = get_backend("cpu")
    assert cpu.native_rms_norm(torch.bfloat16, KERNELS)
    assert not cpu.native_rms_norm(torch.float16, KERNELS)
    args = {"dtype": "bfloat16", "num_kv_blocks": 16, "compile": "off"}
    norms = LLM(str(tiny_llama_dir), **args).engine.runner.model.norm
    assert norms.native
    monkeypatch.setenv(envs.NATIVE_NORM, "0")
    assert not LLM(str(tiny_llama_dir), **args).engine.runner.model.norm.native
