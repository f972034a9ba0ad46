"""A tensor-parallel rank other than 0: `python -m hetero_pd.engine.tp.rank`, started by
rank 0's RankGroup (group.py), which writes its RankStart (spec and the group's secret) as
the first line of its stdin. It loads its shard of the model, allocates its
KV heads, then runs what rank 0 sends until STOP. It owns no scheduler: block ids, slots
and token ids all come from rank 0."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading

import msgspec
import torch
import torch.distributed as dist

from backends import parse_device
from backends.distributed import bind_device, collective_backend
from hetero_pd.config import parse_dtype
from hetero_pd.engine.loading import use_backend_kernels
from hetero_pd.engine.model_runner import ModelRunner
from hetero_pd.engine.tp import rendezvous
from hetero_pd.engine.tp.codec import HEADER_LEN, OP_LOGITS, OP_STEP, Header, decode_step
from hetero_pd.engine.tp.group import IDLE_TIMEOUT, RankSpec, RankStart
from hetero_pd.engine.tp.kv import mapped_slices
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM
from hetero_pd.models.loader import load_model
from hetero_pd.models.parallel import Parallel, shard_config

log = logging.getLogger("hetero_pd.engine.tp")


def _exit_with_parent() -> None:
    """Rank 0 holds our stdin open: when it closes, rank 0 is gone and so are we."""
    sys.stdin.buffer.read()
    os._exit(3)


class Rank:
    def __init__(self, spec: RankSpec, secret: bytes) -> None:
        self.device = parse_device(spec.device)
        self.dtype = parse_dtype(spec.dtype)
        torch.set_num_threads(spec.threads)
        bind_device(self.device)
        store = rendezvous.open_store(spec.store, spec.world)
        store.set(f"joined/{spec.rank}", "1")
        with rendezvous.loopback_gloo():
            dist.init_process_group(
                collective_backend(self.device),
                store=store,
                rank=spec.rank,
                world_size=spec.world,
                timeout=datetime.timedelta(seconds=spec.timeout_s),
            )
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        for group, device in ((self.control, torch.device("cpu")), (None, self.device)):
            failed = rendezvous.prove(secret, spec.rank, spec.world, group, device)
            if failed:
                sys.exit(rendezvous.refusal(failed, spec.rank))
        cfg = ModelConfig.from_dir(spec.model)
        tp = Parallel(spec.rank, spec.world, None)
        self.model: CausalLM = load_model(
            spec.model, cfg, self.dtype, self.device, spec.max_model_len, tp
        )
        use_backend_kernels(self.model, self.device, self.dtype)  # rank 0's kernels
        kv_allocator = None  # a worker's ranks share its whole-head KV (kv.py)
        if spec.kv_files:
            files, blocks = list(spec.kv_files), spec.num_blocks
            kv_allocator = mapped_slices(cfg, tp, files, blocks, spec.block_size, self.dtype)
        self.runner = ModelRunner(
            self.model,
            shard_config(cfg, tp),
            spec.num_blocks,
            spec.block_size,
            self.device,
            self.dtype,
            kv_allocator,
            kv_layout=spec.kv_layout,
        )
        self.hidden_size = cfg.hidden_size
        dist.barrier(group=self.control)  # loaded: rank 0's wait_loaded returns

    @torch.inference_mode()
    def serve(self) -> None:
        """Runs rank 0's messages until STOP."""
        while True:
            header_t = torch.empty(HEADER_LEN, dtype=torch.long)
            dist.broadcast(header_t, 0, group=self.control)
            h = Header.from_tensor(header_t)
            if h.op == OP_STEP:
                self._step(h)
            elif h.op == OP_LOGITS:
                rows = torch.empty(h.rows, self.hidden_size, dtype=self.dtype, device=self.device)
                dist.broadcast(rows, 0)
                self.model.compute_logits(rows)
            else:
                return

    def _step(self, h: Header) -> None:
        longs = torch.empty(h.n_long, dtype=torch.long)
        dist.broadcast(longs, 0, group=self.control)
        bools = torch.empty(h.n_bool, dtype=torch.uint8)
        if h.n_bool:
            dist.broadcast(bools, 0, group=self.control)
        r = self.runner
        ids, positions, meta = decode_step(
            h, longs, bools, self.device, r.kv_layout, r.native_decode
        )
        self.model(positions, meta, r.kv_caches, input_ids=ids)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-rank %(message)s")
    if len(sys.argv) != 1:
        sys.exit(
            "usage: python -m hetero_pd.engine.tp.rank (started by rank 0: RankStart on stdin)"
        )
    start = msgspec.json.decode(sys.stdin.buffer.readline(), type=RankStart)
    # Rank 0 stops us (STOP, or its exit closing our stdin): a Ctrl-C reaching the whole
    # process group must not kill a rank under a draining worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    rank = Rank(start.spec, bytes.fromhex(start.secret))
    rank.serve()
    dist.destroy_process_group()
    # Nothing is left to flush (stdout is /dev/null, logging flushes each record; rank 0
    # owns the KV files): exit now, not after the interpreter's teardown, which with torch
    # takes seconds on a busy machine while rank 0 waits for us.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
