"""The drill's client: what an application on another host does, with the official `openai`
client, plus the router's /health and /metrics. Every function here runs on a thread inside
the client host's network namespace (`Lab.call_in`), so it reaches the router only over the
lab's bridge; the threads it starts inherit that namespace."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from threading import Event
from typing import Any

from hetero_pd.deploy.testing import metric_value

TRANSFER_BYTES = "hetero_pd_kv_transfer_bytes_total"
TRANSFER_SECONDS = "hetero_pd_kv_transfer_seconds_sum"
DECISIONS = "hetero_pd_policy_decisions_total"
FAILURES = "hetero_pd_kv_transfer_failures_total"


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's outcome: its text, or why it failed, and its client-side timings."""

    text: str = ""
    error: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Api:
    url: str  # http://router:port
    key: str
    model: str
    timeout_s: float = 120.0

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        status, text = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
        return metric_value(text, name, **labels)

    def complete(
        self, prompt: list[int], max_tokens: int, stream: bool, first: Event | None = None
    ) -> Answer:
        """One greedy completion (ignore_eos: exactly `max_tokens` tokens); `first` is set
        when its first token arrives."""
        import openai

        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=self.timeout_s
        )
        start = time.monotonic()
        args: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        args.update(temperature=0, extra_body={"ignore_eos": True})
        try:
            if not stream:
                r = client.completions.create(**args)
                took = time.monotonic() - start
                return Answer(r.choices[0].text, seconds=took)
            parts, started = [], 0.0
            for chunk in client.completions.create(stream=True, **args):
                if chunk.choices and not started:
                    started = time.monotonic()
                    if first is not None:
                        first.set()
                parts += [c.text for c in chunk.choices]
            end = time.monotonic()
            tpot = (end - started) / max(1, max_tokens - 1)
            text = "".join(parts)
            return Answer(text, ttft_s=started - start, tpot_s=tpot, seconds=end - start)
        except openai.APIError as e:
            return Answer(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
        finally:
            client.close()

    def workers(self) -> dict[str, dict[str, Any]]:
        """The router's view of its workers (/health), {} while it does not answer."""
        try:
            _, text = self.get("/health")
            body: dict[str, dict[str, Any]] = json.loads(text).get("workers", {})
            return body
        except (OSError, ValueError):
            return {}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, detail: Callable[[], str]
) -> None:
    """Polls `check` until it holds; raises TimeoutError naming `what` and `detail()`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s; {detail()}")
        time.sleep(0.2)


def alive(api: Api, ids: set[str], pids: dict[str, int] | None = None) -> bool:
    """Whether the router sees every worker in `ids` alive (with another pid than `pids`)."""
    seen = api.workers()
    return all(
        seen.get(w, {}).get("alive") and (pids is None or seen[w].get("pid") != pids.get(w))
        for w in ids
    )


def under_load(
    api: Api,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    action: Callable[[], None],
) -> list[Answer]:
    """Streams every prompt, `concurrency` at a time, runs `action` (a kill) as soon as the
    first token of any of them arrived, and returns every answer (each within the client's
    timeout: a hang is an error)."""
    first = Event()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(api.complete, p, max_tokens, True, first) for p in prompts]
        if not first.wait(api.timeout_s):
            raise TimeoutError("no request got its first token: nothing was under load")
        action()
        return [f.result(timeout=api.timeout_s + 30) for f in futures]


def sequential(api: Api, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """One streamed request at a time, with the KV bytes, transfer time and policy decision
    the router recorded for it (deltas of /metrics around it)."""
    rows = []
    for prompt in prompts:
        before = _counters(api)
        answer = api.complete(prompt, max_tokens, stream=True)
        after = _counters(api)
        delta = {k: after[k] - before[k] for k in after}
        rows.append({"answer": answer, **delta})
    return rows


def transferred_cleanly(row: dict[str, Any]) -> bool:
    """Whether a request of `sequential` was prefilled remotely and its KV crossed the link
    without a failed transfer, a retry, a recomputation, or a wait for the transfer engine's
    ACK timeout (a transfer that took that long waited for a timer, it did not move bytes)."""
    from transfer import TransferConfig

    moved = row["disaggregated"] == 1 and row["kv_bytes"] > 0
    failed = row["recompute"] or row["retry"] or row["fail"] or row["transfer_failures"]
    return moved and not failed and row["kv_seconds"] < TransferConfig().ack_timeout_s


def anonymous_hello(address: str, wait_s: float = 3.0) -> bytes | None:
    """What a worker's control socket answers a `hello` from a peer that does not know the
    deployment secret (None: nothing, as it must)."""
    import zmq

    from hetero_pd.serving.control import protocol

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        try:  # a DEALER blocks while no peer accepted it: not accepting is the answer too
            sock.send(protocol.worker_codec().encode(protocol.Hello()), zmq.NOBLOCK)
        except zmq.Again:
            return None
        if sock.poll(int(wait_s * 1000)):
            return bytes(sock.recv())
        return None
    finally:
        sock.close()
        ctx.term()


def _counters(api: Api) -> dict[str, float]:
    status, text = api.get("/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
    out = {
        "kv_bytes": metric_value(text, TRANSFER_BYTES, transport="kv"),
        "kv_seconds": metric_value(text, TRANSFER_SECONDS, transport="kv"),
    }
    for decision in ("disaggregated", "local_prefill", "recompute", "retry", "fail"):
        out[decision] = metric_value(text, DECISIONS, decision=decision)
    failed = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(FAILURES)]
    out["transfer_failures"] = sum(float(v) for v in failed)
    return out
