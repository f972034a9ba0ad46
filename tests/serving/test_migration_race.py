"""A request that finishes on its decode worker while the router asks to move it.

The router learns that a request ended from its last output, which can still be queued when
a drain sends MigrateOut for it: the worker refuses ("it is not decoding here"). That is not
a failed migration, nothing needed moving. Found with forked workers, whose fast restarts let
a rolling restart's drain meet requests finishing in that window (8 counted as failed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hetero_pd.serving.control import migration as M
from hetero_pd.serving.router.migration import Migration, Migrator
from hetero_pd.serving.worker.migration import Migrations
from transfer import RemoteBlocks


def source_book(sent: list[tuple[bytes, Any]]) -> Migrations:
    """A worker's migrations, with no requests of its own, whose messages land in `sent`."""
    engine = SimpleNamespace(config=SimpleNamespace(start_layer=0, block_size=16))
    return Migrations(
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lambda owner, msg: sent.append((owner, msg)),
        requests={},
        children={},
        drop=lambda req: None,
        timeout_s=1.0,
    )


def test_the_source_says_a_request_it_no_longer_decodes_is_not_here() -> None:
    sent: list[tuple[bytes, Any]] = []
    book = source_book(sent)
    blocks = RemoteBlocks("gone", 1, (0, 1), "kv")
    msg = M.MigrateOut(
        rid="gone", dest_worker_id="decode-1", dest_address="127.0.0.1:1", dest_blocks=blocks
    )
    book.start_out(b"router", msg)
    [(owner, failed)] = sent
    assert owner == b"router" and isinstance(failed, M.MigrateFailed)
    assert failed.not_here and "not decoding here" in failed.message
    assert not book.active


def test_a_drain_does_not_count_a_request_that_ended_as_a_failed_move() -> None:
    """evacuate moves what decodes on the worker; a move refused as not_here is looked at
    again (here: the request is gone by then) and is in neither the moved nor the failed."""
    streams = {"r1": SimpleNamespace(decode=SimpleNamespace(worker_id="d0"), decoding=True,
                                     migratable=True, dest=None)}  # fmt: skip
    source = SimpleNamespace(gone=False, inflight={})
    calls: list[str] = []

    class OneWorker(Migrator):
        def destination(self, source: Any, dest_id: str | None) -> Any:
            return None  # some other decode worker would take it

        async def migrate(
            self, rid: str, dest_id: str | None = None, precopy: bool = True, reason: str = ""
        ) -> Migration:
            calls.append(rid)
            streams.pop(rid)  # its last output reached the router meanwhile
            return Migration(rid, "d0", "d1", False, "copy: refused", not_here=True)

    migrator = OneWorker.__new__(OneWorker)
    migrator.streams = streams  # type: ignore[assignment]
    migrator.workers = {"d0": source}  # type: ignore[dict-item]
    done = asyncio.run(migrator.evacuate("d0", timeout_s=5.0))
    assert calls == ["r1"]
    assert done == []


def test_a_source_that_always_says_not_here_holds_a_drain_no_longer_than_its_timeout() -> None:
    """A worker answering every MigrateOut with not_here (a hostile or broken one) keeps its
    requests, as a refusal would: the drain looks again each turn and ends at its timeout,
    with nothing recorded as moved or failed."""
    streams = {"r1": SimpleNamespace(decode=SimpleNamespace(worker_id="d0"), decoding=True,
                                     migratable=True, dest=None)}  # fmt: skip
    asked: list[str] = []

    class Liar(Migrator):
        def destination(self, source: Any, dest_id: str | None) -> Any:
            return None

        async def migrate(
            self, rid: str, dest_id: str | None = None, precopy: bool = True, reason: str = ""
        ) -> Migration:
            asked.append(rid)
            return Migration(rid, "d0", "d1", False, "copy: refused", not_here=True)

    migrator = Liar.__new__(Liar)
    migrator.streams = streams  # type: ignore[assignment]
    migrator.workers = {"d0": SimpleNamespace(gone=False, inflight={})}  # type: ignore[dict-item]
    done = asyncio.run(asyncio.wait_for(migrator.evacuate("d0", timeout_s=0.5), 10))
    assert done == []
    assert len(asked) >= 2  # looked at again, turn after turn, until the timeout


def test_a_request_that_ends_while_its_kv_is_copied_is_not_here(monkeypatch: Any) -> None:
    """The source copies a request's KV in rounds while it decodes on; when a round ends the
    request may have finished (its last output still on its way to the router) or been
    preempted (it decodes again later). Neither is a failed move: the drain looks again. A
    rolling restart under load counted six such requests as failed (CI, 2026-12-06)."""
    from hetero_pd.serving.worker import migration as W

    sent: list[tuple[bytes, Any]] = []
    book = source_book(sent)
    monkeypatch.setattr(W.E, "decoding", lambda engine, rid: None)  # not in the batch now
    blocks = RemoteBlocks("r", 1, (0, 1), "kv")
    book._out["r"] = W._Out(b"router", "decode-1", blocks, [W._Part("r", 0, (0, 1), 0, sent=1)])
    book._advance("r")  # its first round's pushes are done: no handles left
    [(owner, failed)] = sent
    assert owner == b"router" and isinstance(failed, M.MigrateFailed)
    assert failed.not_here, failed
    assert not book.active
