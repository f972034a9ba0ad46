"""A step's inputs survive the tensor-parallel codec exactly; a message that does not add
up is refused by name."""

from __future__ import annotations

import pytest
import torch

from hetero_pd.engine.tp.codec import Header, StepMessageError, decode_step, encode_step
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan

CPU = torch.device("cpu")


def sample_meta() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    # 2 decode rows (context 5), a fresh 3-token prefill, a 2-token chunk on 6 cached tokens
    ids, positions = torch.arange(7) + 100, torch.tensor([4, 2, 0, 1, 2, 6, 7])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(7) * 3,
        num_decode_tokens=2,
        decode_slots=torch.arange(10) + 40,
        decode_mask=(torch.arange(10) % 4 != 3).view(2, 1, 1, 5),
        prefills=[
            PrefillSpan(2, 5),
            PrefillSpan(5, 7, torch.arange(8) + 60, torch.rand(2, 8) > 0.5),
        ],
    )
    return ids, positions, meta


def test_round_trip() -> None:
    ids, positions, meta = sample_meta()
    header, longs, bools = encode_step(ids, positions, meta)
    header = Header.from_tensor(header.tensor())
    got_ids, got_pos, got = decode_step(header, longs, bools, CPU, "nd", True)
    assert torch.equal(got_ids, ids) and torch.equal(got_pos, positions)
    assert torch.equal(got.slot_mapping, meta.slot_mapping)
    assert got.num_decode_tokens == 2 and got.native_decode
    assert meta.decode_slots is not None and meta.decode_mask is not None
    assert torch.equal(got.decode_slots, meta.decode_slots)
    assert torch.equal(got.decode_mask, meta.decode_mask)
    assert [(s.start, s.end) for s in got.prefills] == [(2, 5), (5, 7)]
    assert got.prefills[0].context_slots is None and got.prefills[0].mask is None
    want = meta.prefills[1]
    assert torch.equal(got.prefills[1].context_slots, want.context_slots)
    assert torch.equal(got.prefills[1].mask, want.mask)


def test_bad_messages_are_refused() -> None:
    ids, positions, meta = sample_meta()
    header, longs, bools = encode_step(ids, positions, meta)
    with pytest.raises(StepMessageError, match="bad tensor-parallel message header"):
        Header.from_tensor(torch.tensor([9, 0, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(StepMessageError, match="out of range"):
        Header.from_tensor(torch.tensor([1, -1, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(StepMessageError, match="needs more"):
        decode_step(header, longs[:-1], bools, CPU, "nd", False)
    with pytest.raises(StepMessageError, match="longer than its header"):
        decode_step(header, torch.cat([longs, longs[:1]]), bools, CPU, "nd", False)
