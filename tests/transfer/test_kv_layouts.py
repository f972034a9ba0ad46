"""KV block layouts: the documented index mapping, and transfers that convert layout, dtype
and block size on receipt (bfloat16 fractal_nz -> float32 nd and back) on every transport."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import pytest
import torch

from transfer import KVRegion, StatusCode, TransferConfig, TransferEngine, TransferState, wire
from transfer.errors import TransferError
from transfer.kv_layouts import CONVERSIONS, FRACTAL_NZ, LAYOUTS, ND, nd_to_nz, nz_c0, nz_to_nd
from transfer.messages import Regions

INNER = (4, 8)  # kv_heads x head_dim: 32 values per token (2 strips of bf16, 4 of fp32)
_ids = itertools.count()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fractal_nz_offsets_follow_the_documented_formula(dtype: torch.dtype) -> None:
    bs, width = 16, 32
    nd = torch.arange(2 * bs * width, dtype=torch.float32).to(dtype).view(2, bs, *INNER)
    nz = nd_to_nz(nd)
    assert nz.shape == nd.shape and nz.dtype == dtype
    c0 = nz_c0(dtype)
    assert c0 == 32 // torch.empty((), dtype=dtype).element_size()
    flat_nd, flat_nz = nd.reshape(2, -1), nz.reshape(2, -1)
    for b, t, c in itertools.product(range(2), range(bs), range(width)):
        offset = (c // c0) * bs * c0 + t * c0 + c % c0
        assert flat_nz[b, offset] == flat_nd[b, t * width + c]
    assert torch.equal(nz_to_nd(nz), nd)


def test_every_pair_of_layouts_has_a_conversion() -> None:
    assert set(CONVERSIONS) == set(itertools.product(LAYOUTS, LAYOUTS))


def test_region_refuses_a_layout_its_blocks_cannot_have() -> None:
    with pytest.raises(TransferError, match="multiple of 16"):
        KVRegion.allocate("kv", 1, 4, (16, 3, 4), torch.bfloat16, layout=FRACTAL_NZ)
    with pytest.raises(TransferError, match="unknown KV layout"):
        KVRegion.allocate("kv", 1, 4, (16, *INNER), layout="zz")


def test_region_descriptions_validate_the_layout() -> None:
    desc = KVRegion.allocate("kv", 1, 4, (16, *INNER), layout=FRACTAL_NZ).describe()
    header = wire.decode(wire.encode(Regions(regions=[desc])), 1)
    assert isinstance(header.msg, Regions) and header.msg.regions[0].layout == FRACTAL_NZ
    as_sent = msgspec.to_builtins(Regions(regions=[desc]))
    for bad in ("zz", 3, None):
        as_sent["regions"][0]["fmt"] = bad
        forged = {"v": wire.VERSION, "sid": b"", "m": as_sent}
        with pytest.raises(wire.FrameError, match=r"regions\[0\]\.fmt"):
            wire.decode(wire.seal(msgspec.msgpack.encode(forged)), 1)


@pytest.fixture
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    n = next(_ids)
    cfg = TransferConfig(secret=b"s", chunk_bytes=4096, timeout_s=10)
    p, d = TransferEngine(f"p-fmt-{n}", "prefill", cfg), TransferEngine(f"d-fmt-{n}", "decode", cfg)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _nd_truth(seed: int, blocks: int, bs: int) -> list[torch.Tensor]:
    """Per tensor (2 layers x K/V), the logical nd blocks, bfloat16-representable."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, bs, *INNER, generator=gen).bfloat16() for _ in range(4)]


@pytest.mark.parametrize("transport", ["local", "shm", "tcp"])
@pytest.mark.parametrize("dst_bs", [16, 8])
def test_bf16_fractal_nz_lands_as_float32_nd(
    engines: tuple[TransferEngine, TransferEngine], transport: str, dst_bs: int
) -> None:
    """An NPU-layout bfloat16 prefill region -> a float32 nd decode region, checksums on:
    the decode worker holds exactly the bfloat16 values, as float32, token by token."""
    p, d = engines
    truth = _nd_truth(1, 8, 16)
    src = KVRegion("kv", [nd_to_nz(t) for t in truth], layout=FRACTAL_NZ)
    p.register_region(src)
    dst = KVRegion.allocate("kv", 2, 32, (dst_bs, *INNER), torch.float32, shared=True)
    d.register_region(dst)
    p.link(d.engine_id, d.address)
    src_ids, tokens = [5, 1, 6], 40
    dst_ids = [3, 9, 4] if dst_bs == 16 else [2, 11, 30, 7, 5]
    recv = d.reserve("r", dst_ids, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, src_ids, recv.blocks, num_tokens=tokens, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert recv.wait(10) is TransferState.DONE
    for got, want in zip(dst.tensors, truth, strict=True):
        landed = got[dst_ids].reshape(-1, *INNER)[:tokens]
        assert torch.equal(landed, want[src_ids].reshape(-1, *INNER)[:tokens].float())


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_float32_nd_lands_as_bf16_fractal_nz(
    engines: tuple[TransferEngine, TransferEngine], transport: str
) -> None:
    p, d = engines
    truth = [t.float() for t in _nd_truth(2, 8, 16)]
    p.register_region(KVRegion("kv", truth))
    dst = KVRegion.allocate("kv", 2, 16, (16, *INNER), torch.bfloat16, layout=FRACTAL_NZ)
    d.register_region(dst)
    p.link(d.engine_id, d.address)
    recv = d.reserve("r", [7, 2], writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, [0, 3], recv.blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    for got, want in zip(dst.tensors, truth, strict=True):
        assert torch.equal(nz_to_nd(got[[7, 2]]), want[[0, 3]].bfloat16())


def test_nz_destination_refuses_another_block_size(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    p, d = engines
    p.register_region(KVRegion("kv", [t.float() for t in _nd_truth(3, 4, 16)]))
    d.register_region(KVRegion.allocate("kv", 2, 16, (8, *INNER), layout=FRACTAL_NZ))
    p.link(d.engine_id, d.address)
    recv = d.reserve("r", [1, 2], writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, [0], recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.PARAM_INVALID
    assert "needs an nd destination" in h.error.message
    assert ND in LAYOUTS


def _engine(name: str, fingerprint: str) -> TransferEngine:
    cfg = TransferConfig(secret=b"s", fingerprint=fingerprint, link_timeout_s=5.0)
    return TransferEngine(f"{name}-{next(_ids)}", "decode", cfg)


def test_mismatched_fingerprints_refuse_the_link_naming_both() -> None:
    """Either side refuses: the listener (AUTH) and the dialler (WELCOME, when the listener
    does not check: here, one that sets no fingerprint links with anyone)."""
    a, b, c, blank = (
        _engine("p", "aaaa1111"),
        _engine("d", "bbbb2222"),
        _engine("d", "aaaa1111"),
        _engine("x", ""),
    )
    try:
        with pytest.raises(TransferError) as info:
            a.link(b.engine_id, b.address)
        err = info.value
        assert err.code is StatusCode.PARAM_INVALID and not err.code.recoverable
        assert "aaaa1111" in err.message and "bbbb2222" in err.message
        assert "fingerprints differ" in err.message
        assert b.metrics().rejected("fingerprint_mismatch") == 1
        assert a.peers() == [] and b.peers() == []
        a.link(c.engine_id, c.address)  # same fingerprint
        blank.link(a.engine_id, a.address)  # not checked when one side has none
        a.register_region(KVRegion.allocate("kv", 2, 8, (16, *INNER)))
        b.register_region(KVRegion.allocate("kv", 2, 8, (16, *INNER)))
        recv = b.reserve("r", [1], writer=a.engine_id)
        assert recv.blocks is not None
        h = a.push_blocks(b.engine_id, [0], recv.blocks, timeout_s=10)
        assert h.wait(10) is TransferState.FAILED  # at once: the error is not recoverable
        assert h.error is not None and "bbbb2222" in h.error.message
        assert h.attempts == 0  # refused at the link: not one attempt, no retry
    finally:
        for eng in (a, b, c, blank):
            eng.close()
