"""Backend.copy_blocks: KV blocks between per-layer block tensors and a host buffer, both
ways, bit-exact for every KV dtype; wrong pairs are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from backends import get_backend

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kv_layers(n: int, num_blocks: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [
        torch.randn(num_blocks, 4, 2, 8, generator=gen).to(device=device, dtype=dtype)
        for _ in range(n)
    ]


def round_trip(kind: str, device: str, dtype: torch.dtype) -> None:
    backend = get_backend(kind)
    layers = kv_layers(6, 10, dtype, device)
    # host side: one contiguous block per slot, [slots, tensors, block...]
    host = backend.pinned_empty((5, 6, 4, 2, 8), dtype)
    views = [host[:, i] for i in range(6)]
    backend.copy_blocks(views, [4, 0, 2], layers, [7, 1, 3])
    for i, layer in enumerate(layers):
        assert torch.equal(host[4, i], layer[7].cpu())
        assert torch.equal(host[0, i], layer[1].cpu())
        assert torch.equal(host[2, i], layer[3].cpu())
    back = [torch.zeros_like(t) for t in layers]
    stream = backend.new_stream(layers[0].device)
    backend.copy_blocks(back, [9, 5, 0], views, [4, 0, 2], stream=stream)
    for layer, copy in zip(layers, back, strict=True):
        assert torch.equal(copy[9].view(torch.uint8), layer[7].view(torch.uint8))
        assert torch.equal(copy[5], layer[1]) and torch.equal(copy[0], layer[3])
        assert not copy[1:5].any(), "a block outside the ids was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    round_trip("cpu", "cpu", dtype)


@pytest.mark.device
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    round_trip("cuda", "cuda", dtype)


def test_mismatched_pairs_are_refused() -> None:
    backend = get_backend("cpu")
    a = kv_layers(2, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="as many dst as src"):
        backend.copy_blocks(a, [0], a[:1], [1])
    with pytest.raises(ValueError, match="as many dst as src"):
        backend.copy_blocks(a, [0, 1], a, [1])
    half = [t.half() for t in a]
    with pytest.raises(ValueError, match="matching blocks"):
        backend.copy_blocks(half, [0], a, [1])
    backend.copy_blocks(a, [], a, [])  # nothing to do
