"""The receiver's checks of direct writes (``local``, ``shm``, ``cuda_ipc``): the writer
copied the chunks into our blocks itself, so we verify what landed there, not what came in::

    LANDED {seqs, digests, wv=False} ──> hash those chunks in our blocks now (read back)
    LANDED {seqs, digests, wv=True}  ──> remember the writer's word (it hashed our blocks)
    END {digests}  ──> the grant closes; read back every chunk not verified yet or whose
                       digest changed, plus spot checks of those the writer vouched for
                   ──> direct_verdict = the bad chunks (the receiver NACKs them, or commits)

Reading back happens on the hashing threads; :class:`~transfer.receiver.Receiver` handles an
END that waited for them once none is left (``resume_end``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from transfer import layout, wire
from transfer.hashing import Hasher, tensor_digest
from transfer.incoming import DIRECT, Early, InTransfer
from transfer.messages import Landed
from transfer.metrics import Metrics

T = TypeVar("T")


class DirectChecks:
    """Verifies direct writes into our blocks (I/O thread only)."""

    def __init__(
        self,
        metrics: Metrics,
        hasher: Hasher,
        still_verifying: Callable[[InTransfer, int], bool],
        resume_end: Callable[[InTransfer], None],
    ) -> None:
        self.metrics, self.hasher = metrics, hasher
        #: Takes chunk ``seq`` off ``verifying``; False when its transfer is gone meanwhile.
        self._still_verifying = still_verifying
        #: Handles an END that waited for verifications, once none is left.
        self._resume_end = resume_end

    def on_landed(self, incoming: InTransfer, msg: Landed) -> None:
        """A direct writer's chunks are in our blocks: verify them now, while it copies the
        next ones (END then only checks what was not verified here, or changed digest).
        Chunks the writer verified itself (``wv``) are not read here: it hashed them in our
        blocks while they were in its cache; END reads back only spot checks of them
        (:func:`spot_checks`), enough to catch a writer that claims copies it never made."""
        if incoming.mode not in DIRECT or incoming.algo is None:
            return
        if msg.grant != incoming.grant:
            return  # about an earlier attempt's copies (it arrived late): they were rewritten
        seqs, digests = msg.seqs, msg.digests  # types and bounds checked by the decoder
        if len(seqs) > incoming.num_chunks or any(seq >= incoming.num_chunks for seq in seqs):
            raise wire.FrameError("bad_field", "landed.s")
        if len(digests) != len(seqs):
            raise wire.FrameError("bad_field", "landed.ds")
        incoming.last_seen = time.monotonic()
        if msg.writer_verified:  # the writer hashed these in our blocks right after copying them
            for seq, expected in zip(seqs, digests, strict=True):
                incoming.early[seq] = Early(expected, good=True, by_writer=True)
            return
        chunks = incoming.plan()
        self.metrics.of(incoming.mode).chunks_read_back_total += len(seqs)
        for seq, expected in zip(seqs, digests, strict=True):
            value = tensor_digest(incoming.algo, self._landed_image(incoming, chunks[seq]))
            incoming.early[seq] = Early(expected, good=value == expected, by_writer=False)

    def _landed_image(self, incoming: InTransfer, chunk: layout.Chunk) -> torch.Tensor:
        return layout.landed_image(
            incoming.region.tensors[chunk.ti],
            incoming.dst_ids,
            chunk.lo,
            chunk.hi - chunk.lo,
            incoming.src_block_shape[0],
            incoming.num_tokens,
            incoming.dst_run,
        )

    def check(self, incoming: InTransfer, digests: list[int] | None) -> None:
        """Start comparing our blocks with the writer's digests, chunk by chunk on the
        hashing threads (chunks verified as they landed are not read again);
        ``direct_verdict`` lists the bad chunks once all are checked."""
        if incoming.algo is None:
            incoming.direct_verdict = []
            return
        chunks = incoming.plan()
        if digests is None or len(digests) != len(chunks):
            incoming.direct_verdict = [c.seq for c in chunks]
            return
        bad: list[int] = []
        todo, claimed = [], []
        for chunk, expected in zip(chunks, digests, strict=True):
            seen = incoming.early.get(chunk.seq)
            if seen is None or seen.digest != expected:
                todo.append((chunk, expected))
            elif not seen.good:
                bad.append(chunk.seq)
            elif seen.by_writer:
                claimed.append((chunk, expected))
        todo += spot_checks(claimed)
        incoming.early.clear()
        if not todo:
            incoming.direct_verdict = sorted(bad)
            return
        incoming.verifying = {chunk.seq for chunk, _ in todo}
        self.metrics.of(incoming.mode).chunks_read_back_total += len(todo)
        for chunk, expected in todo:
            image = self._landed_image(incoming, chunk)

            def verdict(value: int | None, seq: int = chunk.seq, want: int = expected) -> None:
                if not self._still_verifying(incoming, seq):
                    return
                if value != want:
                    bad.append(seq)
                if not incoming.verifying:
                    incoming.direct_verdict = sorted(bad)
                    self._resume_end(incoming)

            self.hasher.then(self.hasher.submit(incoming.algo, image), verdict)


#: One in this many chunks a writer says it verified is read back anyway (at least one per
#: transfer), chosen at END, after the grant closed, where the writer cannot know which.
SPOT_CHECK_EVERY = 16
_spot = random.SystemRandom()


def spot_checks(claimed: list[T]) -> list[T]:
    """The chunks the writer vouched for that we read back ourselves: one at random, and
    each other one with probability 1 / ``SPOT_CHECK_EVERY``. A writer that skipped a
    copy is caught for sure if it skipped them all, and with that probability per chunk
    otherwise; honest writers cost us a sixteenth of a read-back."""
    if not claimed:
        return []
    first = _spot.randrange(len(claimed))
    return [
        c for i, c in enumerate(claimed) if i == first or _spot.randrange(SPOT_CHECK_EVERY) == 0
    ]
