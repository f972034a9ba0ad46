"""The public transfer engine: one per worker process.

Decode side (receiver)::

    eng = TransferEngine("decode-0", Role.DECODE)
    eng.register_region(KVRegion.allocate("kv", 30, 1024, (16, 3, 64), shared=True))
    h = eng.reserve("req-1", block_ids=[3, 4, 9], writer="prefill-0")  # hand h.blocks over
    ... eng.progress() / h.wait() ...                   # DONE once every layer committed
    eng.release("req-1")                                # after use, timeout or abort

Prefill side (sender), streaming layer ranges as they are computed::

    eng.set_peer_address("decode-0", address)           # never blocks; links by itself
    for l0, l1 in layer_chunks:
        hs.append(eng.push_blocks("decode-0", src_block_ids, blocks, layers=(l0, l1)))
    ... when all hs are terminal, free the source blocks (h.released says why) ...

The grants (writer, offers), leases and health calls are described in ``transfer/README.md``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Sequence

from transfer.addresses import parse_endpoint
from transfer.auth import check_secret
from transfer.checksum import requested as checksum_requested
from transfer.config import Role, TransferConfig
from transfer.core import Core
from transfer.errors import StatusCode, TransferError
from transfer.handle import Callback, RemoteBlocks, TransferHandle
from transfer.metrics import TransferHealth, TransferMetrics
from transfer.offers import new_offer
from transfer.outgoing import new_push
from transfer.pulls import new_pull
from transfer.region import KVRegion


class TransferEngine:
    """Moves KV blocks between workers (see the module docstring for the flow)."""

    def __init__(
        self, engine_id: str, role: Role | str = Role.BOTH, config: TransferConfig | None = None
    ) -> None:
        self.engine_id = engine_id
        self.role = Role(role)
        self.config = config or TransferConfig()
        if self.config.require_secret and not self.config.per_peer_secrets:
            check_secret(self.config.host, self.config.secret)
        self._core = Core(engine_id, self.role, self.config)
        self._loop = self._core.loop
        self._ids = itertools.count()
        self._callback_errors = 0  # callbacks that raised in progress()

    @property
    def address(self) -> str:
        """ZMQ endpoint peers pass to :meth:`link` (``tcp://host:port``, advertised host)."""
        return self._core.address

    @property
    def data_address(self) -> str:
        """``host:port`` of the data channel listener ("" when ``data_channel`` is off)."""
        return self._core.me.data_address

    # ---- links --------------------------------------------------------------------------
    def trust(self, peer_id: str, secret: bytes) -> None:
        """Link with ``peer_id`` under ``secret``, which only it and we hold (``per_peer_secrets``;
        :class:`~transfer.auth.PeerSecrets`): ids never trusted are refused (AUTH_FAILED)."""
        self._core.linker.secrets.add(peer_id, secret)

    def link(self, peer_id: str, address: str, timeout: float | None = None) -> None:
        """Connect and authenticate to ``peer_id`` listening at ``address``.

        Blocks until linked (at most ``link_timeout_s``); raises PARAM_INVALID for an address
        that is not ``tcp://host:port``, LINK_FAILED / AUTH_FAILED otherwise. Linking is
        needed once per pair, from either side: both may then push and pull. Transfers
        re-link by themselves. A worker loop should use :meth:`link_async` or
        :meth:`set_peer_address` instead, which never block.
        """
        wait = timeout if timeout is not None else self.config.link_timeout_s
        try:
            self.link_async(peer_id, address).result(wait + 1.0)
        except concurrent.futures.TimeoutError:
            raise TransferError(
                StatusCode.LINK_FAILED, f"{peer_id} at {address}: timed out"
            ) from None

    def link_async(self, peer_id: str, address: str) -> concurrent.futures.Future[None]:
        """Start linking to ``peer_id`` at ``address``; returns at once.

        The future completes when linked, or fails with the :class:`TransferError` that
        :meth:`link` would raise (a bad address fails it immediately). Also remembers the
        address, as :meth:`set_peer_address` does.
        """
        linker = self._core.linker
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            parse_endpoint(address)
        except TransferError as exc:
            fut.set_exception(exc)
            return fut
        self._loop.call(lambda: linker.connect(peer_id, address, fut))
        return fut

    def set_peer_address(self, peer_id: str, address: str) -> None:
        """Where ``peer_id`` listens (``tcp://host:port``); returns at once.

        Call it with the router's view before each request (a no-op while unchanged): when
        the address differs from the current link's (the peer restarted elsewhere), that
        session is dropped and a new link starts at once; transfers waiting on it resume on
        the new one. With no session up, the link starts now too. Raises PARAM_INVALID for an
        address that does not parse.
        """
        parse_endpoint(address)
        linker = self._core.linker
        self._loop.call(lambda: linker.moved(peer_id, address))

    def unlink(self, peer_id: str) -> None:
        """Drop every session with ``peer_id``; its transfers fail or time out."""
        linker = self._core.linker
        self._loop.call_wait(lambda: linker.unlink(peer_id), self.config.link_timeout_s)

    def peers(self) -> list[str]:
        """Ids of peers with a live session."""
        return self._core.linker.peers()

    # ---- regions and reservations -------------------------------------------------------
    def register_region(self, region: KVRegion) -> None:
        """Make ``region`` available for pushes (as destination) and offers (as source)."""
        region.claim(self.engine_id)
        core = self._core
        self._loop.call_wait(lambda: core.add_region(region), 10.0)

    def region(self, name: str = "kv") -> KVRegion:
        """A registered region."""
        try:
            return self._core.regions[name]
        except KeyError:
            raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {name!r}") from None

    def reserve(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        region: str = "kv",
        layers: tuple[int, int] | None = None,
        timeout_s: float | None = None,
        callback: Callback | None = None,
        writer: str | None = None,
    ) -> TransferHandle:
        """Accept pushes for ``request_id`` into ``block_ids`` (decode side).

        Returns a ``kind="recv"`` handle: ``handle.blocks`` (a :class:`RemoteBlocks`) is what
        the sender needs; the handle is DONE when every layer in ``layers`` (default: all)
        has been committed, TIMED_OUT after ``timeout_s`` (then late writes are refused).
        ``writer`` is the one peer engine id allowed to write these blocks (a push or the
        answer to our pull); any other peer is refused with NOT_GRANTED and counted in
        ``frames_rejected["not_granted"]``. None lets any authenticated peer write them.
        """
        self._loop.check_open()
        reg = self.region(region)
        handle = TransferHandle(f"{self.engine_id}/recv/{request_id}", "recv", "", request_id)
        handle.cancel_with(lambda h: self.release(h.request_id))
        if callback is not None:
            handle.add_done_callback(callback)
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        layer_range = range(*reg.layer_bounds(layers))
        ids = list(block_ids)
        self._core.ledger.reserve(reg, request_id, ids, layer_range, handle, deadline, writer)
        handle.nbytes = len(ids) * reg.block_bytes * len(reg.tensor_range(layers))
        return handle

    def release(self, request_id: str) -> float:
        """Free a reservation (after use, timeout or abort); late writes are refused. Returns
        seconds until its blocks may be reused: 0.0, unless a direct (shared-memory) writer
        still holds a grant on them."""
        core = self._core
        reservation, wait = core.ledger.release(request_id)
        if reservation is not None:
            released = reservation
            self._loop.call(lambda: core.drop_reservation(released))
        return wait

    # ---- transfers ----------------------------------------------------------------------
    def push_blocks(
        self,
        peer: str,
        src_blocks: Sequence[int],
        dst: RemoteBlocks,
        *,
        layers: tuple[int, int] | None = None,
        region: str = "kv",
        num_tokens: int | None = None,
        transfer_id: str | None = None,
        transport: str | None = None,
        checksum: bool | str | None = None,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        callback: Callback | None = None,
    ) -> TransferHandle:
        """Copy our blocks ``src_blocks`` (layers ``[l0, l1)``) into the peer's ``dst``.

        Returns at once (linking first if needed). Keep the source blocks until the handle
        is terminal; ``released`` then says whether the ACK or the lease ended the hold.
        ``transfer_id`` makes the push idempotent across caller retries; ``checksum``
        overrides the configured default (True/False or an algorithm name); ``transport``
        forces one (``"tcp"``, ``"shm"``, ``"local"``).
        """
        reg = self.region(region)
        first, last = reg.layer_bounds(layers)
        transfer_id = (
            transfer_id or f"{self.engine_id}/{dst.request_id}/{first}-{last}/{next(self._ids)}"
        )
        out = new_push(
            transfer_id,
            peer,
            reg,
            list(src_blocks),
            dst,
            (first, last),
            num_tokens,
            checksum_requested(checksum, self.config.checksum_algo),
            transport,
            timeout_s or self.config.timeout_s,
            lease_s or self.config.lease_s,
        )
        sender = self._core.sender
        out.handle.cancel_with(lambda h: self._loop.call(lambda: sender.cancel(h)))
        if callback is not None:
            out.handle.add_done_callback(callback)
        self._loop.call(lambda: sender.start(out))
        return out.handle

    def pull_blocks(
        self,
        peer: str,
        src_blocks: RemoteBlocks | Sequence[int],
        dst: RemoteBlocks,
        *,
        src_region: str = "kv",
        layers: tuple[int, int] | None = None,
        num_tokens: int | None = None,
        transfer_id: str | None = None,
        timeout_s: float | None = None,
        callback: Callback | None = None,
    ) -> TransferHandle:
        """Fetch the peer's offered blocks into our reservation ``dst``.

        ``src_blocks`` is the ticket the peer's :meth:`offer` returned (its request id,
        epoch, block ids and region): the peer serves only what it offered to us, for that
        epoch, within the offered layers and before the offer's lease ends; anything else
        fails with NOT_GRANTED. (Plain block ids name no offer and are always refused.)
        ``dst`` comes from our own :meth:`reserve`. The peer serves the pull as a push (leased
        by its offer); the handle is DONE once the data committed here.
        """
        reg = self.region(dst.region)
        first, last = reg.layer_bounds(layers)
        transfer_id = transfer_id or (
            f"{self.engine_id}/pull/{dst.request_id}/{first}-{last}/{next(self._ids)}"
        )
        pull = new_pull(
            transfer_id,
            peer,
            reg,
            src_blocks,
            src_region,
            dst,
            (first, last),
            num_tokens,
            timeout_s or self.config.timeout_s,
            self.config.ack_timeout_s,
        )
        if callback is not None:
            pull.handle.add_done_callback(callback)
        puller = self._core.puller
        self._loop.call(lambda: puller.start(pull))
        return pull.handle

    def offer(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        reader: str,
        region: str = "kv",
        layers: tuple[int, int] | None = None,
        lease_s: float | None = None,
        callback: Callback | None = None,
    ) -> TransferHandle:
        """Let peer ``reader`` pull our blocks ``block_ids`` (``layers``) for ``request_id``.

        Returns a ``kind="offer"`` handle whose ``blocks`` is the ticket to hand to the reader
        (through the control plane) for its :meth:`pull_blocks`. Keep the blocks until the
        handle is terminal: DONE once every offered layer was pulled and ACKed, TIMED_OUT
        (LEASE_EXPIRED) when ``lease_s`` (default ``TransferConfig.lease_s``) passes first,
        CANCELLED after :meth:`withdraw`. No other peer, epoch, block or layer is served.
        """
        reg = self.region(region)
        ids, bounds = list(block_ids), reg.layer_bounds(layers)
        handle = new_offer(self.engine_id, reg, request_id, ids, reader, bounds)
        handle.cancel_with(lambda h: self.withdraw(h.request_id))
        if callback is not None:
            handle.add_done_callback(callback)
        lease, now = lease_s or self.config.lease_s, time.monotonic()
        self._core.offers.add(reg.name, request_id, ids, reader, range(*bounds), lease, handle, now)
        return handle

    def withdraw(self, request_id: str) -> None:
        """End our offer for ``request_id``: later pulls are refused, pulls in flight stop;
        the offer's handle turns CANCELLED once nothing reads its blocks any more."""
        pulls = self._core.pulls
        self._loop.call(lambda: pulls.withdraw(request_id))

    # ---- leases -------------------------------------------------------------------------
    def renew(self, request_id: str, seconds: float | None = None) -> None:
        """Keep what this engine holds for ``request_id`` alive (call it on each heartbeat).

        Extends, to now + ``seconds`` (default: each one's own original duration), the
        deadline of our reservation, the leases of our pushes and our offer for that request.
        Never shortens anything; a request that holds nothing here is ignored.
        """
        core, now = self._core, time.monotonic()
        core.ledger.renew(request_id, now, seconds)
        self._loop.call(lambda: core.renew_held(request_id, now, seconds))

    def renew_remote(self, peer: str, blocks: RemoteBlocks) -> None:
        """Ask ``peer`` to keep its reservation or offer ``blocks`` alive (fire and forget).

        A writer renews the reservation it will push into (a long prefill); a reader renews
        the offer it will pull (vLLM's decode heartbeats). The peer extends it by its own
        original duration, only for the grantee named in it; others are counted and ignored.
        """
        core = self._core
        self._loop.call(lambda: core.send_renew(peer, blocks))

    # ---- progress, health, metrics, lifecycle -------------------------------------------
    def progress(self) -> list[TransferHandle]:
        """Finished handles since the last call; runs their callbacks here, contained."""
        done = []
        completed = self._loop.completed
        while completed:
            handle = completed.popleft()
            self._callback_errors += handle._run_callbacks()
            done.append(handle)
        return done

    poll = progress

    def healthy(self) -> bool:
        """True while the engine's I/O thread runs; False once closed or after it died."""
        return self._loop.thread.is_alive() and not self._loop.closing

    def health(self) -> TransferHealth:
        """Whether the I/O thread runs, why it died, and the bugs it contained so far, for
        the worker's health report: a worker whose transfer engine is unhealthy is not."""
        return TransferHealth(
            healthy=self.healthy(),
            closed=self._loop.closing,
            error=self._loop.fatal,
            internal_errors=self._core.metrics.internal_errors_total,
            callback_errors=self._callback_errors,
        )

    def metrics(self) -> TransferMetrics:
        """A snapshot of the counters and gauges (see transfer/README.md, Metrics)."""
        return self._core.metrics_snapshot()

    def held_blocks(self) -> dict[str, int]:
        """Source blocks still held by unfinished sends and live offers, per region."""
        held = self._loop.call_wait(self._core.held_ids, 10.0)
        return {name: len(ids) for name, ids in held.items()}

    def check_integrity(self) -> None:
        """Raise INTERNAL if the ledger's block ownership is inconsistent (tests, idle)."""
        self._core.ledger.check_integrity()

    def reserved_blocks(self) -> dict[str, int]:
        """Destination blocks still reserved, per region (0 after every release)."""
        return self._core.ledger.reserved_blocks()

    def close(self, close_regions: bool = True) -> None:
        """Stop the engine; unfinished handles fail with ENGINE_CLOSED."""
        loop = self._loop
        if not loop.closing:
            loop.call(lambda: setattr(loop, "closing", True))
        loop.thread.join(10.0)
        self.progress()
        if close_regions:
            for region in self._core.regions.values():
                region.close()  # idempotent

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
