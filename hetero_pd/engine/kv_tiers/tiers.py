"""KVTiers: the host-DRAM and SSD tiers as the KV cache manager sees them, in block ids and
hashes (copies run on the mover's threads).

Admission: a block goes down only once it has been seen `admit_after` times (default twice:
computed or hit by two requests), so one-off prompts never push reused prefixes out of the
host tier. It goes down
when a request frees it while it is still cached on the device, so that evicting it later
costs nothing; the SSD gets every block the host tier takes (write-through), which is also
what survives a restart. Lookups walk a prompt's chained block hashes past the device's
last hit: the run found in the tiers is brought up before the request is scheduled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from backends import Backend
from hetero_pd.engine.kv_tiers.disk import DiskTier
from hetero_pd.engine.kv_tiers.host import HostTier
from hetero_pd.engine.kv_tiers.mover import Job, Offload, Onload, TierMover
from hetero_pd.engine.kv_tiers.stats import KVTierStats, TierStats

Block = tuple[int, tuple[int, ...]]  # (chained hash, token ids)


class KVTiers:
    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None,
        mover: TierMover,
        backend: Backend,
        admit_after: int = 2,
    ) -> None:
        self.host, self.disk, self.mover, self.backend = host, disk, mover, backend
        self.admit_after = admit_after
        self.block_bytes = host.block_bytes
        self._device = mover.device_layers[0].device
        # bounded: counts of blocks not seen for a long time are forgotten
        self._seen: OrderedDict[int, int] = OrderedDict()
        self._seen_limit = 4 * (host.num_slots + (disk.capacity_files if disk else 0)) + 1024
        self._offloading: set[int] = set()
        self._host_writes = self._host_hits = self._disk_hits = self._corrupt = 0
        self._skipped = self._onloads = self._onload_blocks = 0
        self._onload_s_total = self._onload_s_max = 0.0

    # -- admission and offload ---------------------------------------------------------
    def note_seen(self, block_hash: int) -> None:
        """A request computed or reused this block."""
        count = self._seen.pop(block_hash, 0) + 1
        self._seen[block_hash] = count
        if len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)
        if count >= self.admit_after:
            self.host.touch(block_hash)

    def admits(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether a cached device block should be copied down now."""
        return (
            self._seen.get(block_hash, 0) >= self.admit_after
            and block_hash not in self._offloading
            and not self.host.contains(block_hash, token_ids)
        )

    def offload(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> list[int]:
        """Starts copying cached device blocks, (block id, hash, token ids) each, down to
        host memory; returns the ids of those taken (a host slot was free), which the caller
        keeps from reuse until the job comes back from `poll()`."""
        slots: list[int] = []
        for _ in blocks:
            slot = self.host.reserve()
            if slot is None:
                self._skipped += len(blocks) - len(slots)
                break
            slots.append(slot)
        if not slots:
            return []
        taken = blocks[: len(slots)]
        ready = self.backend.new_event(self._device)
        if ready is not None:
            ready.record()  # after the steps that computed the blocks, on the compute stream
        self._offloading.update(h for _, h, _ in taken)
        block_ids = [b for b, _, _ in taken]
        job = Offload(block_ids, [h for _, h, _ in taken], [t for _, _, t in taken], slots, ready)
        self.mover.submit(job)
        return block_ids

    # -- lookup and onload -------------------------------------------------------------
    def find_run(self, blocks: list[Block]) -> int:
        """How many of `blocks`, from the first, some tier holds."""
        for i, (block_hash, tokens) in enumerate(blocks):
            in_disk = self.disk is not None and self.disk.contains(block_hash)
            if not in_disk and not self.host.contains(block_hash, tokens):
                return i
        return len(blocks)

    def onload(
        self, request_id: str, blocks: list[Block], allocate: Callable[[int], list[int]]
    ) -> int:
        """Starts bringing up `blocks` (from the first, as many as are still in the tiers
        and have a host slot now) into device blocks from `allocate(n)`, which the caller
        holds until the job comes back from `poll()`. Returns how many it took."""
        slots: list[int | None] = []
        on_disk: list[bool] = []
        for block_hash, tokens in blocks:
            slot = self.host.pin(block_hash, tokens)
            from_disk = slot is None
            if from_disk and self.disk is not None and self.disk.contains(block_hash):
                slot = self.host.reserve()
            if slot is None:
                break
            slots.append(slot)
            on_disk.append(from_disk)
        n = len(slots)
        if n:
            job = Onload(
                request_id,
                allocate(n),
                [h for h, _ in blocks[:n]],
                [t for _, t in blocks[:n]],
                slots,
                on_disk,
                num_valid=n,
            )
            self.mover.submit(job)
        return n

    # -- completions -------------------------------------------------------------------
    def poll(self) -> list[Job]:
        """Jobs whose copies are done; the caller gives back their device blocks."""
        jobs = self.mover.completed()
        for job in jobs:
            if isinstance(job, Offload):
                self._offloading.difference_update(job.hashes)
                self._host_writes += len(job.hashes) if job.ok else 0
                continue
            self._onloads += 1
            self._onload_blocks += job.num_valid
            self._disk_hits += job.disk_hits
            self._host_hits += job.num_valid - job.disk_hits
            self._corrupt += job.corrupt
            self._onload_s_total += job.seconds
            self._onload_s_max = max(self._onload_s_max, job.seconds)
        return jobs

    @property
    def busy(self) -> bool:
        return self.mover.in_flight > 0

    def wait_copies(self, timeout: float = 30.0) -> None:
        self.mover.wait_copies(timeout)

    def wait_done(self, timeout: float, all_jobs: bool = False) -> None:
        self.mover.wait_done(timeout, all_jobs)

    def stats(self, device_hits: int) -> KVTierStats:
        bb = self.block_bytes
        host_n = self.host.num_stored
        host = TierStats(
            hits=self._host_hits,
            hit_bytes=self._host_hits * bb,
            writes=self._host_writes,
            write_bytes=self._host_writes * bb,
            evictions=self.host.evictions,
            stored_blocks=host_n,
            stored_bytes=host_n * bb,
            capacity_bytes=self.host.num_slots * bb,
        )
        disk = None
        if self.disk is not None:
            d, disk_n = self.disk, self.disk.num_stored
            disk = TierStats(
                hits=self._disk_hits,
                hit_bytes=self._disk_hits * bb,
                writes=d.writes,
                write_bytes=d.writes * bb,
                evictions=d.evictions,
                stored_blocks=disk_n,
                stored_bytes=disk_n * d.file_bytes,
                capacity_bytes=d.capacity_files * d.file_bytes,
            )
        return KVTierStats(
            device_hits=device_hits,
            device_hit_bytes=device_hits * bb,
            host=host,
            disk=disk,
            disk_corrupt=self._corrupt,
            offloads_skipped=self._skipped,
            onloads=self._onloads,
            onload_blocks=self._onload_blocks,
            onload_seconds_total=self._onload_s_total,
            onload_seconds_max=self._onload_s_max,
        )

    def check_integrity(self) -> None:
        """With no job in flight: every host slot accounted for, nothing pinned."""
        assert not self.busy and not self._offloading, "KV tier jobs still in flight"
        self.host.check_integrity()

    def close(self) -> None:
        """Stops the threads (after the jobs queued) and releases the SSD folder."""
        self.mover.close()
        if self.disk is not None:
            self.disk.close()
