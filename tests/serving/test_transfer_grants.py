"""The transfer engine's guarantees, end to end through serving: a decode worker's reserved
blocks take writes only from the prefill worker the router chose for them (another worker
that links with its own pair key is refused with NOT_GRANTED), and a decode worker
restarted on new ports by the supervisor gets the next prompt's KV at once, without waiting
out a transfer timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack, wait_gone
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control.auth import RouterKeys, secure_client
from transfer import (
    KVRegion,
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferState,
)

from .test_failures import DECISIONS, complete_all, delta, greedy, transfer_metrics


def received(stack: Stack, worker: str) -> int:
    """Transfers `worker`'s transfer engine committed, over every transport."""
    return sum(int(c["transfers_received_total"]) for c in transfer_metrics(stack, worker).values())


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.05)


class SecondRouter:
    """An authenticated router of the deployment talking to one worker directly."""

    def __init__(self, address: str, secret: bytes, worker_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        secure_client(self.sock, RouterKeys.from_secret(secret), worker_id)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec = P.router_codec()
        # A worker hears only routers that greeted it (its own router's start() does too).
        self.ask(P.Hello(), P.Ready)

    def ask(self, msg: msgspec.Struct, answer: type[Any], timeout_s: float = 20.0) -> Any:
        self.sock.send(P.worker_codec().encode(msg))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                reply = self.codec.decode(self.sock.recv())
                if isinstance(reply, P.Error):
                    raise AssertionError(f"the worker refused {type(msg).__name__}: {reply}")
                if isinstance(reply, answer):
                    return reply
        raise AssertionError(f"no {answer.__name__} within {timeout_s}s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_only_the_chosen_prefill_worker_writes_reserved_blocks(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """Blocks reserved for prefill-0's push refuse another worker of the deployment,
    prefill-1 (an in-process engine the router gave its pair key with decode-0, so it links),
    over TCP and shared memory alike; the decode worker commits nothing from it, and the
    deployment's own disaggregated requests still land there."""
    dep = deployment(tiny_llama_dir)
    prompt = random_prompts([60], seed=5)[0]
    with running_stack(dep) as stack:
        assert stack.router is not None and stack.launcher is not None
        decode = stack.router.workers["decode-0"]
        secret = stack.launcher.secret
        router = SecondRouter(decode.address, secret, "decode-0")
        keys = RouterKeys.from_secret(secret)
        try:
            pair = keys.link_key("decode-0", "prefill-1")
            introduce = P.PeerKeys(keys=[P.PeerKey(peer="prefill-1", key=pair)])
            router.sock.send(P.worker_codec().encode(introduce))
            reserved = router.ask(
                P.Reserve(
                    rid="granted",
                    prompt_ids=prompt,
                    params=P.WireParams.of(greedy(4)),
                    writer="prefill-0",
                ),
                P.Reserved,
            )
            dest = reserved.blocks
            intruder = TransferEngine(
                "prefill-1",
                "prefill",
                TransferConfig(per_peer_secrets=True, transports=("shm", "tcp")),
            )
            try:
                intruder.trust("decode-0", pair)
                info = decode.info
                region = KVRegion.allocate(
                    "kv", 3, info.num_blocks, (info.block_size, 2, 16), torch.float32
                )
                region.tensors[0].fill_(-7.0)
                intruder.register_region(region)
                intruder.link("decode-0", info.transfer_address)
                for transport in ("tcp", "shm"):
                    push = intruder.push_blocks(
                        "decode-0", list(dest.block_ids), dest, transport=transport
                    )
                    assert push.wait(20) is TransferState.FAILED, transport
                    assert push.error is not None, transport
                    assert push.error.code is StatusCode.NOT_GRANTED, (transport, push.error)
            finally:
                intruder.close()
            router.sock.send(P.worker_codec().encode(P.Abort(rid="granted")))
            since = time.monotonic()
            wait_for("a heartbeat", lambda: decode.last_seen > since)
            assert received(stack, "decode-0") == 0
        finally:
            router.close()
        stack.wait_idle()

        # The deployment's own prefill worker, the one granted, still writes there.
        before = stack.metrics()
        expected = tiny_reference.texts([prompt], greedy(8))
        assert complete_all(stack, [prompt], 8) == expected
        assert delta(stack, before, DECISIONS, decision="disaggregated") == 1
        assert delta(stack, before, DECISIONS, decision="recompute") == 0
        wait_for("the KV to be counted", lambda: received(stack, "decode-0") >= 1)
        stack.wait_idle()


def test_a_restarted_decode_worker_gets_the_next_kv_at_once(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """SIGKILL the decode worker; the supervisor restarts it on new ports. The prefill
    worker learns the new address from the next Prefill and re-links at once: that request
    lands by transfer (no recompute, no fallback), well inside the 30 s transfer timeout."""
    import os
    import signal

    dep = deployment(tiny_llama_dir, supervisor={"backoff_s": 0.0})
    prompts = random_prompts([70, 90], seed=8)
    expected = tiny_reference.texts(prompts, greedy(8))
    with running_stack(dep) as stack:
        assert stack.router is not None and stack.launcher is not None
        assert complete_all(stack, prompts[:1], 8) == expected[:1]  # prefill-0 linked now
        old = stack.router.workers["decode-0"].info
        pid = stack.launcher.pids()["decode-0"]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid], 10.0) == []

        def restarted() -> bool:
            assert stack.router is not None and stack.launcher is not None
            client = stack.router.workers["decode-0"]
            new_pid = stack.launcher.pids().get("decode-0", pid)
            return new_pid != pid and client.alive and client.info.pid == new_pid

        wait_for("decode-0 restarted", restarted, timeout_s=120.0)
        new = stack.router.workers["decode-0"].info
        assert new.transfer_address != old.transfer_address

        before = stack.metrics()
        start = time.monotonic()
        assert complete_all(stack, prompts[1:], 8, timeout_s=60.0) == expected[1:]
        took = time.monotonic() - start
        assert took < dep.transfer.timeout_s, f"{took:.1f}s: it waited for a timeout"
        assert delta(stack, before, DECISIONS, decision="disaggregated") == 1
        assert delta(stack, before, DECISIONS, decision="recompute") == 0
        wait_for("the KV to be counted", lambda: received(stack, "decode-0") >= 1)
        assert stack.router.workers["decode-0"].load.kv_fallbacks == 0
        stack.wait_idle()
