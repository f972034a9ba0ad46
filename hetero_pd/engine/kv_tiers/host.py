"""The host-DRAM tier: KV blocks in slots of one host buffer, indexed by block hash, LRU.

A slot is in exactly one of three states::

    free      in `_free`, holds nothing
    reserved  handed to a copy that is filling it (not in the index, not free)
    stored    in the index under a block hash; `pins` > 0 while a copy reads it

Eviction takes the least recently used stored slot with no pins. Every method takes the
tier's lock, so the engine thread and the copy threads may call it at the same time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Entry:
    slot: int
    token_ids: tuple[int, ...]
    pins: int = 0


class HostTier:
    def __init__(self, buffer: torch.Tensor) -> None:
        """`buffer`: [num_slots, *block] host memory, one KV block (all layers) per slot."""
        if buffer.device.type != "cpu" or buffer.shape[0] < 1:
            raise ValueError(f"the host KV tier needs a host buffer of slots, got {buffer.shape}")
        self.buffer = buffer
        self.num_slots = int(buffer.shape[0])
        self.block_bytes = buffer[0].numel() * buffer.element_size()
        self._free = list(range(self.num_slots))
        self._index: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.evictions = 0

    def layer_views(self) -> list[torch.Tensor]:
        """One [num_slots, *layer_block] view per KV tensor: copy_blocks' host side."""
        return [self.buffer[:, i] for i in range(self.buffer.shape[1])]

    @property
    def num_stored(self) -> int:
        with self._lock:
            return len(self._index)

    def contains(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        with self._lock:
            entry = self._index.get(block_hash)
            return entry is not None and entry.token_ids == token_ids

    def touch(self, block_hash: int) -> None:
        """Marks a block recently used (its device copy was just hit)."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def pin(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this block, kept from eviction until `unpin`; None if absent."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or entry.token_ids != token_ids:
                return None
            entry.pins += 1
            self._index.move_to_end(block_hash)
            return entry.slot

    def unpin(self, block_hash: int) -> None:
        with self._lock:
            entry = self._index[block_hash]
            if entry.pins <= 0:
                raise RuntimeError(f"host KV block {block_hash:#x} unpinned more than pinned")
            entry.pins -= 1

    def reserve(self) -> int | None:
        """A slot for a copy to fill, evicting the least recently used unpinned block if the
        tier is full; None when every slot is pinned or being filled."""
        with self._lock:
            if self._free:
                return self._free.pop()
            for block_hash, entry in self._index.items():
                if entry.pins == 0:
                    del self._index[block_hash]
                    self.evictions += 1
                    return entry.slot
            return None

    def store(self, slot: int, block_hash: int, token_ids: tuple[int, ...], pin: bool) -> bool:
        """Publishes a filled reserved slot under `block_hash` (pinned if `pin`); when the
        block is already stored elsewhere, frees the slot and returns False."""
        with self._lock:
            if block_hash in self._index:
                self._free.append(slot)
                return False
            self._index[block_hash] = _Entry(slot, token_ids, 1 if pin else 0)
            return True

    def release(self, slot: int) -> None:
        """Gives back a reserved slot that was never stored."""
        with self._lock:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """With no copy in flight: raises AssertionError unless free and stored slots
        account for every slot, no slot is in two places and nothing is pinned."""
        with self._lock:
            slots = self._free + [e.slot for e in self._index.values()]
            assert len(slots) == len(set(slots)) == self.num_slots, (len(slots), self.num_slots)
            assert all(e.pins == 0 for e in self._index.values()), "a host block is still pinned"
