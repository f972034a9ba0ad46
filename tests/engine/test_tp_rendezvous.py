"""A tensor-parallel engine's rendezvous admits only the ranks it started: a hostile local
process finds no store to connect to (every socket the group listens on is gloo's, on
127.0.0.1, and none answers as a store), cannot read the group's secret from a command line
or environment, and a rank that cannot prove the secret is refused by name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.tp.group import RankGroup, TPRankError
from tests.engine.test_greedy_equivalence import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

# Store clients as a hostile process would run them, one thread per port (a client that
# reaches something other than a store may wait forever): it prints what each port gave.
HOSTILE = """
import datetime, os, sys, threading, time
import torch.distributed as dist
seen = {}
def probe(port):
    try:
        c = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=1))
        seen[port] = "KEYS " + repr(c.list_keys())
    except Exception as e:
        seen[port] = "refused " + type(e).__name__
ports = [int(p) for p in sys.argv[1:]]
for port in ports:
    threading.Thread(target=probe, args=(port,), daemon=True).start()
time.sleep(4)
print({p: seen.get(p, "no answer") for p in ports}, flush=True)
os._exit(0)
"""


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket `pid` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
                family = socket.AF_INET if size == 4 else socket.AF_INET6
                found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hostile_local_process_finds_no_way_into_the_group(
    tiny_llama_dir: Path, hf_greedy: Callable[..., list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets_sent: list[bytes] = []
    spawn = RankGroup._spawn

    def spying_spawn(self: RankGroup, *args: object) -> subprocess.Popen[bytes]:
        secrets_sent.append(bytes(args[-1]))  # type: ignore[arg-type]
        return spawn(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RankGroup, "_spawn", spying_spawn)
    # While the ranks join, rank 0 listens on nothing at all (the store was a port then).
    joining: list[set[tuple[str, int]]] = []
    wait_joined = RankGroup._wait_joined

    def spying_wait(self: RankGroup, store: object) -> None:
        wait_joined(self, store)
        joining.append(_listening(os.getpid()) - before)

    monkeypatch.setattr(RankGroup, "_wait_joined", spying_wait)
    before = _listening(os.getpid())
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert joining == [set()], joining
        ranks = llm.engine.ranks
        assert ranks is not None
        child = ranks.procs[0].pid
        sockets = (_listening(os.getpid()) - before) | _listening(child)
        assert sockets, "the group listens somewhere (gloo's pairs)"
        # Nothing reachable from another host: the store used to listen on every interface.
        assert {addr for addr, _ in sockets} == {"127.0.0.1"}, sockets
        ports = sorted(str(port) for _, port in sockets)
        probe = subprocess.run(
            [sys.executable, "-c", HOSTILE, *ports], capture_output=True, text=True, timeout=60
        )
        assert "KEYS" not in probe.stdout, probe.stdout
        assert probe.stdout.count("refused") + probe.stdout.count("no answer") == len(ports), (
            probe.stdout + probe.stderr
        )
        # The secret reached the rank on its stdin: not on a command line, not in /proc.
        assert len(secrets_sent) == 1 and len(secrets_sent[0]) >= 32
        secret_hex = secrets_sent[0].hex().encode()
        for name in ("cmdline", "environ"):
            with open(f"/proc/{child}/{name}", "rb") as f:
                seen = f.read()
            assert secret_hex not in seen and secrets_sent[0] not in seen
        # The hostile connections did not disturb the group.
        prompts = random_prompts([5, 11], 512, seed=3)
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    finally:
        llm.engine.close()


def test_a_rank_that_cannot_prove_the_secret_is_refused(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawn = RankGroup._spawn

    def impostor_spawn(self: RankGroup, *args: object) -> subprocess.Popen[bytes]:
        return spawn(self, *args[:-1], os.urandom(32))  # type: ignore[arg-type]

    monkeypatch.setattr(RankGroup, "_spawn", impostor_spawn)
    with pytest.raises(TPRankError, match="rank 1 did not prove the group's secret"):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()
