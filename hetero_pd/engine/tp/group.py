"""Rank 0's side of a tensor-parallel engine: it starts the other ranks as its own child
processes, joins them in torch.distributed, sends each step's inputs, gathers the logits,
and stops them.

::

    rank 0 (the engine's process)           ranks 1..N-1 (python -m hetero_pd.engine.tp.rank)
    spec + secret on the child's stdin ----> joined/<r> in a private file store, then
    init_process_group, each rank proving    init_process_group on loopback (rendezvous.py)
    the secret to every other <----------->
    load its shard                          load their shards, allocate their KV heads
    barrier (control group) <-------------> barrier: every rank loaded
    step:   header, ints, flags (control) -> forward on their shards
            all-reduces (world) <--------->
    logits: header (control), rows (world) -> lm_head on their vocab slices
            gather (world) <---------------
    close:  STOP (control) ----------------> exit 0

The world group's collectives time out (envs.tp_timeout_s); the control group waits as long
as the engine idles. A rank that dies closes its sockets, so the peers' next collective
fails at once; a child whose parent died sees its stdin close and exits.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import IO, Any

import msgspec
import torch
import torch.distributed as dist

from backends import parse_device
from backends.distributed import bind_device, collective_backend, rank_device
from hetero_pd import envs
from hetero_pd.config import EngineConfig
from hetero_pd.engine.health import EngineFault
from hetero_pd.engine.tp import rendezvous
from hetero_pd.engine.tp.codec import OP_LOGITS, OP_STEP, OP_STOP, Header, encode_step
from hetero_pd.models.attention import AttentionMetadata
from hetero_pd.models.parallel import Parallel

#: The control group's timeout: it waits while the engine idles, so practically forever.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TPRankError(EngineFault):
    """A tensor-parallel rank died, or a collective failed or timed out: the ranks are out
    of step, so the whole engine stops (a supervisor restarts the worker group)."""


class RankSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a child rank is told (on its stdin, in a RankStart)."""

    model: str
    rank: int
    world: int
    #: the private folder of the group's file store (rendezvous.py).
    store: str
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_layout: str
    threads: int
    timeout_s: float
    #: rank 0's whole-head KV files to map (tp/kv.py); empty: the rank allocates its own.
    kv_files: tuple[str, ...] = ()


class RankStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The one JSON line rank 0 writes on a child's stdin: its spec and the group's secret
    (hex), which so never appears on a command line or in an environment."""

    spec: RankSpec
    secret: str


class RankGroup:
    """The other ranks of this engine, as seen from rank 0."""

    def __init__(self, spec: RankSpec, device: torch.device) -> None:
        """Starts ranks 1..world-1 from `spec` (rank 0's own) and joins them; returns once
        every rank is in the group (their weights may still be loading: `wait_loaded`)."""
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: it runs one "
                "tensor-parallel engine at a time (close the other engine first)"
            )
        self.world, self.timeout_s, self.device = spec.world, spec.timeout_s, device
        #: Rank 0's KV tensors are the whole-head cache every rank maps (tp/kv.py), so they
        #: hold every head, as a TP 1 engine's do; else each rank keeps its heads apart.
        self.kv_whole = bool(spec.kv_files)
        self.broken: str | None = None
        # The children's stderr, for error messages; closed by close().
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._folder = rendezvous.private_folder()
        spec = msgspec.structs.replace(spec, store=self._folder)
        store = rendezvous.open_store(self._folder, spec.world)
        secret = rendezvous.new_secret()
        self.procs = [self._spawn(spec, r, secret) for r in range(1, spec.world)]
        self._finalizer = weakref.finalize(self, _release, list(self.procs), self._folder)
        self._wait_joined(store)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        bind_device(device)
        with rendezvous.loopback_gloo():
            dist.init_process_group(
                collective_backend(device),
                store=store,
                rank=0,
                world_size=spec.world,
                timeout=timeout,
            )
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._prove(secret)
        self.parallel = Parallel(0, spec.world, None)

    def _spawn(self, spec: RankSpec, rank: int, secret: bytes) -> subprocess.Popen[bytes]:
        device = rank_device(self.device, rank)
        child = msgspec.structs.replace(spec, rank=rank, device=str(device))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.update(rendezvous.LOOPBACK_ENV)
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetero_pd.engine.tp.rank"],
            stdin=subprocess.PIPE,  # closed when this process dies: the child exits
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(RankStart(child, secret.hex())) + b"\n")
        proc.stdin.flush()
        return proc

    def _prove(self, secret: bytes) -> None:
        """Every rank proves the secret over the control group's and the world group's own
        connections before any step travels on them (rendezvous.prove)."""
        for group, device in ((self.control, torch.device("cpu")), (None, self.device)):
            with self.guard("proving the ranks"):
                failed = rendezvous.prove(secret, 0, self.world, group, device)
            if failed:
                self.broken = rendezvous.refusal(failed, 0)
                self.close()
                raise TPRankError(self.broken)

    def _wait_joined(self, store: Any) -> None:
        """Waits until every child has reached the store, failing early if one exits."""
        deadline = time.monotonic() + self.timeout_s
        keys = [f"joined/{r}" for r in range(1, self.world)]
        while not store.check(keys):
            self._raise_if_exited("starting")
            if time.monotonic() > deadline:
                self.close()
                raise TPRankError(f"tensor-parallel ranks did not start in {self.timeout_s} s")
            time.sleep(0.02)

    def wait_loaded(self) -> None:
        """Returns once every rank has loaded its shard and allocated its KV."""
        with self.guard("loading the model"):
            dist.barrier(group=self.control)

    # -- one step --------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Anything that fails inside leaves the ranks out of step: the group is broken and
        the failure a TPRankError naming the rank that died, if one did."""
        if self.broken is not None:
            raise TPRankError(self.broken)
        try:
            yield
        except Exception as e:
            self.broken = self._describe_failure(what, e)
            self.close()
            raise TPRankError(self.broken) from e

    def send_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Tells the other ranks to run a forward pass on these inputs (inside `guard`)."""
        header, longs, bools = encode_step(input_ids, positions, meta)
        assert header.op == OP_STEP
        dist.broadcast(header.tensor(), 0, group=self.control)
        dist.broadcast(longs, 0, group=self.control)
        if header.n_bool:
            dist.broadcast(bools, 0, group=self.control)

    def logits(
        self, compute: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor
    ) -> torch.Tensor:
        """`compute` (the model's compute_logits) on these hidden rows on every rank, the
        vocabulary slices gathered here (inside `guard`)."""
        rows = hidden.contiguous()
        dist.broadcast(Header(OP_LOGITS, rows=rows.shape[0]).tensor(), 0, group=self.control)
        dist.broadcast(rows, 0)
        return compute(rows)

    # -- failure and shutdown ----------------------------------------------------------------
    def check(self) -> None:
        """Raises TPRankError if the group is broken or a rank has exited (no collective:
        safe between steps)."""
        if self.broken is not None:
            raise TPRankError(self.broken)
        self._raise_if_exited("idle")

    def _raise_if_exited(self, what: str) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                self.broken = f"{self._exit_text(rank, p)} while {what}{self._stderr_tail()}"
                self.close()
                raise TPRankError(self.broken)

    def _describe_failure(self, what: str, error: Exception) -> str:
        deadline = time.monotonic() + 2.0  # a killed rank's exit status lags its sockets
        while time.monotonic() < deadline:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return f"{self._exit_text(rank, p)} while {what}{self._stderr_tail()}"
            if not isinstance(error, (RuntimeError, dist.DistError)):
                break
            time.sleep(0.02)
        return (
            f"tensor-parallel {what} failed on rank 0 ({type(error).__name__}: {error}); "
            "the ranks are out of step, so the engine stops"
        )

    @staticmethod
    def _exit_text(rank: int, p: subprocess.Popen[bytes]) -> str:
        code = p.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        return f"tensor-parallel rank {rank} (pid {p.pid}) exited with {how}"

    def _stderr_tail(self) -> str:
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - 2000))
        tail = self._log.read().decode(errors="replace").strip()
        return f"; its last output:\n{tail}" if tail else ""

    def close(self) -> None:
        """Stops the other ranks (STOP when they are in step, else a kill) and leaves the
        group. Safe to call twice."""
        if self.broken is None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.broadcast(Header(OP_STOP).tensor(), 0, group=self.control)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        _reap(self.procs)
        self._finalizer.detach()
        self._log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        rendezvous.remove_folder(self._folder)


def _release(procs: list[subprocess.Popen[bytes]], folder: str) -> None:
    """An engine dropped without close(): its ranks killed, this process's group left, so
    another tensor-parallel engine may start here."""
    _reap(procs)
    if dist.is_initialized():
        dist.destroy_process_group()
    rendezvous.remove_folder(folder)


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kills the child ranks still running (by their pid) and collects them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        stdin: IO[bytes] | None = p.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.close()


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel ranks (processes) the engine in process `worker_pid` started, as
    seen from outside it (Linux /proc; [] elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for entry in filter(str.isdigit, entries):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if parent == worker_pid and b"hetero_pd.engine.tp.rank" in f.read():
                    out.append(int(entry))
    return out


def start_ranks(
    config: EngineConfig,
    model: str,
    dtype: torch.dtype,
    num_blocks: int,
    max_model_len: int,
    kv_files: list[str],
) -> RankGroup:
    """Starts the ranks of a tensor-parallel engine configured by `config` around this
    process (rank 0) for the model folder `model`; each rank runs this process's threads
    and maps `kv_files` as its KV cache (tp/kv.py) if there are some."""
    device = parse_device(config.device)
    spec = RankSpec(
        model=model,
        rank=0,
        world=config.tensor_parallel_size,
        store="",
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        block_size=config.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        kv_layout=config.kv_layout_choice(),
        threads=torch.get_num_threads(),
        timeout_s=envs.tp_timeout_s(),
        kv_files=tuple(kv_files),
    )
    return RankGroup(spec, device)
