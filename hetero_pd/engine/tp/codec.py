"""What rank 0 sends the other ranks of a tensor-parallel engine, as flat tensors (a tensor
broadcast: nothing pickled, every size checked on arrival).

::

    header  int64[8]   op, n_long, n_bool, num_tokens, num_decode, num_spans, context, rows
    STEP    longs      input_ids[T] positions[T] slot_mapping[T] decode_slots[D * context]
                       (start, end, context_len) per span, then each span's context slots
            bools      decode_mask[D * context], then each span's mask [chunk x context_len]
    LOGITS  (hidden rows follow as their own broadcast: [rows, hidden] in the model's dtype)
    STOP    nothing follows
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hetero_pd.models.attention import AttentionMetadata, PrefillSpan

OP_STEP, OP_LOGITS, OP_STOP = 1, 2, 3
OPS = (OP_STEP, OP_LOGITS, OP_STOP)
HEADER_LEN = 8
#: No message is larger (elements): a header claiming more is corrupt, not a big batch.
MAX_ELEMENTS = 1 << 34


class StepMessageError(ValueError):
    """A message between tensor-parallel ranks that does not add up."""


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    n_long: int = 0
    n_bool: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    num_spans: int = 0
    context: int = 0
    rows: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        values = [int(v) for v in t.tolist()]
        if len(values) != HEADER_LEN or values[0] not in OPS:
            raise StepMessageError(f"bad tensor-parallel message header {values}")
        if any(not 0 <= v <= MAX_ELEMENTS for v in values[1:]):
            raise StepMessageError(f"tensor-parallel message header out of range: {values}")
        return cls(*values)


def encode_step(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[Header, torch.Tensor, torch.Tensor]:
    """(header, longs, bools) on the host for one forward pass's inputs."""
    longs = [input_ids, positions, meta.slot_mapping]
    bools: list[torch.Tensor] = []
    nd, context = meta.num_decode_tokens, 0
    if nd:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        context = meta.decode_mask.shape[-1]
        longs.append(meta.decode_slots)
        bools.append(meta.decode_mask.reshape(-1))
    spans = []
    for span in meta.prefills:
        n = 0 if span.context_slots is None else span.context_slots.numel()
        spans += [span.start, span.end, n]
        if span.context_slots is not None and span.mask is not None:
            longs.append(span.context_slots)
            bools.append(span.mask.reshape(-1))
    longs.insert(4 if nd else 3, torch.tensor(spans, dtype=torch.long))
    flat_long = torch.cat([t.reshape(-1).to("cpu", torch.long) for t in longs])
    flat_bool = (
        torch.cat([t.to("cpu", torch.uint8) for t in bools])
        if bools
        else torch.empty(0, dtype=torch.uint8)
    )
    header = Header(
        OP_STEP,
        flat_long.numel(),
        flat_bool.numel(),
        input_ids.numel(),
        nd,
        len(meta.prefills),
        context,
    )
    return header, flat_long, flat_bool


def decode_step(
    h: Header,
    longs: torch.Tensor,
    bools: torch.Tensor,
    device: torch.device,
    kv_layout: str,
    native_decode: bool,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta) on `device` from `encode_step`'s tensors."""
    ints, flags = _Reader(longs.to(device), "ints"), _Reader(bools.to(device, torch.bool), "flags")
    t, nd = h.num_tokens, h.num_decode
    ids, positions, slots = ints.take(t), ints.take(t), ints.take(t)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=nd, kv_layout=kv_layout, native_decode=native_decode
    )
    if nd:
        meta.decode_slots = ints.take(nd * h.context)
        meta.decode_mask = flags.take(nd * h.context).view(nd, 1, 1, h.context)
    spans = ints.take(3 * h.num_spans).view(-1, 3).tolist()
    for start, end, n in spans:
        if not 0 <= start < end <= t:
            raise StepMessageError(f"prefill span [{start}, {end}) outside {t} tokens")
        span = PrefillSpan(start, end)
        if n:
            span.context_slots = ints.take(n)
            span.mask = flags.take((end - start) * n).view(end - start, n)
        meta.prefills.append(span)
    if not (ints.done() and flags.done()):
        raise StepMessageError("step message longer than its header says")
    return ids, positions, meta


class _Reader:
    """Takes consecutive pieces of one flat tensor, refusing to read past its end."""

    def __init__(self, data: torch.Tensor, what: str) -> None:
        self.data, self.what, self.at = data, what, 0

    def take(self, n: int) -> torch.Tensor:
        if self.at + n > self.data.numel():
            have = self.data.numel()
            raise StepMessageError(f"step message holds {have} {self.what}, needs more")
        self.at += n
        return self.data[self.at - n : self.at]

    def done(self) -> bool:
        return self.at == self.data.numel()
