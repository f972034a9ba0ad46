"""The cuda backend. Device tests need a GPU and are skipped without one; the rest checks
the errors a CPU-only host gives."""

from __future__ import annotations

import pytest
import torch

from backends import BackendUnavailableError, get_backend, parse_device

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host's errors")
def test_without_a_gpu_every_device_operation_explains_itself() -> None:
    cuda = get_backend("cuda")
    assert not cuda.is_available()
    assert cuda.device_count() == 0
    assert parse_device("cuda:0") == torch.device("cuda", 0)  # parsing needs no GPU
    gpu = torch.device("cuda", 0)
    for operation in (
        lambda: cuda.device(0),
        lambda: cuda.synchronize(),
        lambda: cuda.memory_info(gpu),
        lambda: cuda.new_stream(gpu),
        lambda: cuda.pinned_empty((4,), torch.float32),
    ):
        with pytest.raises(BackendUnavailableError, match="CUDA is not available"):
            operation()


@pytest.mark.device
@needs_gpu
def test_gpu_discovery_memory_and_pinned_buffers() -> None:
    cuda = get_backend("cuda")
    assert cuda.device_count() == torch.cuda.device_count() >= 1
    gpu = cuda.device(0)
    assert gpu == torch.device("cuda", 0)
    free, total = cuda.memory_info(gpu)
    assert 0 < free <= total
    assert cuda.device_name(gpu)
    assert cuda.supports_ipc()
    buffer = cuda.pinned_empty((8, 16), torch.float16)
    assert buffer.is_pinned() and buffer.device.type == "cpu"


@pytest.mark.device
@needs_gpu
def test_gpu_copies_round_trip_on_a_side_stream() -> None:
    cuda = get_backend("cuda")
    gpu = cuda.device(0)
    host = cuda.pinned_empty((256, 64), torch.float32)
    host.copy_(torch.randn(256, 64))
    on_gpu = torch.empty(256, 64, device=gpu)
    other = torch.empty_like(on_gpu)
    back = cuda.pinned_empty((256, 64), torch.float32)
    stream = cuda.new_stream(gpu)
    start, end = cuda.new_event(gpu, enable_timing=True), cuda.new_event(gpu, enable_timing=True)
    assert isinstance(stream, torch.Stream) and start is not None and end is not None
    with stream:
        start.record(stream)
        cuda.copy(on_gpu, host, non_blocking=True)  # H2D
        cuda.copy(other, on_gpu, non_blocking=True)  # D2D
        cuda.copy(back, other, non_blocking=True)  # D2H
        end.record(stream)
    cuda.synchronize(gpu)
    assert torch.equal(back, host)
    assert start.elapsed_time(end) >= 0


@pytest.mark.device
@needs_gpu
def test_gpu_profile() -> None:
    cuda = get_backend("cuda")
    gpu = cuda.device(0)
    profile = cuda.profile(gpu)
    assert profile.kind == "cuda" and profile.index == 0 and profile.threads == 0
    assert profile.fp32_gflops > 0 and profile.mem_gbps > 0
    assert profile.half_gflops is not None and profile.half_gflops > 0
    assert cuda.profile(gpu) is profile


@pytest.mark.device
@needs_gpu
def test_gpu_auto_dtype_follows_the_checkpoint() -> None:
    cuda = get_backend("cuda")
    gpu = cuda.device(0)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = cuda.auto_dtype(gpu, torch.bfloat16).dtype
    assert bf16 == (torch.bfloat16 if native else torch.float16)
    assert cuda.auto_dtype(gpu, torch.float32).dtype == torch.float16
