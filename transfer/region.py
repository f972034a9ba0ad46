"""KV cache regions: the per-layer tensors a worker registers with its engine.

A region is a list of tensors that all share a leading block dimension::

    tensors = [K_0, V_0, K_1, V_1, ..., K_{L-1}, V_{L-1}]     (tensors_per_layer = 2)
    each:  [num_blocks, block_size, num_kv_heads, head_dim]   (any inner shape works)

``layout`` names the order of the bytes inside each block (``nd``, or the NPU's
``fractal_nz``: see ``transfer/kv_layouts.py``); the tensors keep their logical shape.

Layer ``l`` owns tensors ``l*tpl .. l*tpl+tpl-1``; a layer range ``[l0, l1)`` selects a
contiguous run of tensors, which is what layer-by-layer streaming sends.

A region allocated with ``shared=True`` lives in files under ``/dev/shm`` so that a sender
on the same host can map it and write the destination blocks directly (one copy)::

    /dev/shm/hetero_pd-<pid>-<token>/      made 0700 by the allocating process
        owner                               engine id that registered it (written once)
        <name>.0 .. <name>.<n-1>            one file per tensor

Peers learn only ``token`` (after mutual authentication) and build the path themselves from
the authenticated peer's pid, checking that ``owner`` names that peer's engine id.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import cast

import torch

from transfer import kv_layouts
from transfer.devices import backend_for
from transfer.errors import StatusCode, TransferError
from transfer.messages import Layout, RegionInfo

SHM_ROOT = "/dev/shm"
SHM_PREFIX = "hetero_pd"
#: Locked by the process that owns a region folder for as long as it lives.
OWNER_LOCK = ".owner"
OWNER_FILE = "owner"

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype (``"float16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises PARAM_INVALID for unsupported names."""
    dt = _DTYPES.get(name)
    if dt is None:
        raise TransferError(StatusCode.PARAM_INVALID, f"unsupported dtype {name!r}")
    return dt


@dataclass(slots=True)
class KVRegion:
    """A registered KV cache: ``tensors`` all ``[num_blocks, block_size, *inner]``."""

    name: str
    tensors: list[torch.Tensor]
    tensors_per_layer: int = 2
    shm_paths: list[str] | None = None
    _shm_dir: str | None = field(default=None, repr=False)
    #: Byte order inside each block (``kv_layouts.LAYOUTS``); transfers convert on receipt.
    layout: str = kv_layouts.ND
    #: A shared region's ``OWNER_LOCK`` file, locked while this process holds the region.
    _owner: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if not self.tensors or len(self.tensors) % self.tensors_per_layer:
            raise TransferError(
                StatusCode.PARAM_INVALID,
                f"region {self.name!r}: {len(self.tensors)} tensors is not a multiple of "
                f"tensors_per_layer={self.tensors_per_layer}",
            )
        first = self.tensors[0]
        if first.dim() < 2:
            raise TransferError(StatusCode.PARAM_INVALID, "region tensors need [blocks, ...]")
        for i, t in enumerate(self.tensors):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise TransferError(
                    StatusCode.PARAM_INVALID,
                    f"region {self.name!r}: tensor {i} is {tuple(t.shape)} {t.dtype} on "
                    f"{t.device}, tensor 0 is {tuple(first.shape)} {first.dtype} on {first.device}",
                )
            if not t.is_contiguous():
                raise TransferError(StatusCode.PARAM_INVALID, f"region tensor {i} not contiguous")
        why = kv_layouts.check(self.layout, tuple(first.shape[1:]), first.dtype)
        if why is not None:
            raise TransferError(StatusCode.PARAM_INVALID, f"region {self.name!r}: {why}")

    @classmethod
    def allocate(
        cls,
        name: str,
        num_layers: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        tensors_per_layer: int = 2,
        device: str | torch.device = "cpu",
        shared: bool = False,
        layout: str = kv_layouts.ND,
    ) -> KVRegion:
        """Allocate zeroed tensors; ``block_shape`` is ``(block_size, *inner)``.

        ``shared=True`` (CPU only) backs each tensor with a file in ``/dev/shm`` that peers on
        this host may map; :meth:`close` removes the files.
        """
        shape = (num_blocks, *block_shape)
        count = num_layers * tensors_per_layer
        if not shared:
            dev = torch.device(device)  # host: resident as written (CpuBackend.zeros)
            tensors = [backend_for(dev).zeros(shape, dtype, dev) for _ in range(count)]
            return cls(name, tensors, tensors_per_layer, layout=layout)
        if torch.device(device).type != "cpu":
            raise TransferError(StatusCode.PARAM_INVALID, "shared regions must be on the CPU")
        sweep_stale_shm()
        root, owner = _claimed_folder()
        paths = [os.path.join(root, f"{name}.{i}") for i in range(count)]
        numel = math.prod(shape)
        tensors = []
        for path in paths:
            t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
            t.zero_()  # fault the pages in now, not during the first transfer
            tensors.append(t)
        return cls(name, tensors, tensors_per_layer, paths, root, layout=layout, _owner=owner)

    @property
    def num_layers(self) -> int:
        """Number of layers (tensors // tensors_per_layer)."""
        return len(self.tensors) // self.tensors_per_layer

    @property
    def num_blocks(self) -> int:
        """Blocks per tensor."""
        return int(self.tensors[0].shape[0])

    @property
    def block_size(self) -> int:
        """Tokens per block (dimension 1)."""
        return int(self.tensors[0].shape[1])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one tensor, ``(block_size, *inner)``."""
        return tuple(self.tensors[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        """Element type."""
        return self.tensors[0].dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor."""
        return self.tensors[0][0].numel() * self.tensors[0].element_size()

    def tensor_range(self, layers: tuple[int, int] | None) -> range:
        """Tensor indices covering ``layers`` (all when None); validates the range."""
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        if not 0 <= l0 < l1 <= self.num_layers:
            raise TransferError(
                StatusCode.PARAM_INVALID,
                f"layer range [{l0}, {l1}) outside region {self.name!r} with {self.num_layers}",
            )
        return range(l0 * self.tensors_per_layer, l1 * self.tensors_per_layer)

    def layer_bounds(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """``layers`` validated (all layers when None), as ``(first, last)``."""
        tensors = self.tensor_range(layers)
        return tensors.start // self.tensors_per_layer, tensors.stop // self.tensors_per_layer

    def check_blocks(self, ids: list[int], what: str) -> None:
        """Raise KV_CACHE_NOT_EXIST unless every id is a valid block index."""
        bad = [i for i in ids if not 0 <= i < self.num_blocks]
        if bad:
            raise TransferError(
                StatusCode.KV_CACHE_NOT_EXIST,
                f"{what} block ids {bad[:8]} outside region {self.name!r} "
                f"(0..{self.num_blocks - 1})",
            )

    @property
    def shm_token(self) -> str | None:
        """The random part of our /dev/shm directory name (None unless allocated shared)."""
        if self._shm_dir is None:
            return None
        return os.path.basename(self._shm_dir).rsplit("-", 1)[1]

    def claim(self, engine_id: str) -> None:
        """Record ``engine_id`` as the owner of a shared region (peers check it)."""
        if self._shm_dir is None:
            return
        path = os.path.join(self._shm_dir, OWNER_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            with open(path) as f:
                owner = f.read()
            if owner != engine_id:
                raise TransferError(
                    StatusCode.PARAM_INVALID,
                    f"region {self.name!r} is registered with engine {owner!r} already",
                ) from None
            return
        with os.fdopen(fd, "w") as f:
            f.write(engine_id)

    def describe(self) -> RegionInfo:
        """Wire description sent to peers after mutual authentication (never file paths)."""
        return RegionInfo(
            name=self.name,
            num_layers=self.num_layers,
            tensors_per_layer=self.tensors_per_layer,
            num_blocks=self.num_blocks,
            block_shape=list(self.block_shape),
            dtype=dtype_name(self.dtype),
            device=self.tensors[0].device.type,
            shm=self.shm_token,
            layout=cast(Layout, self.layout),  # one of LAYOUTS: checked when registered
        )

    def close(self) -> None:
        """Remove the shared-memory files (mappings stay valid until dropped)."""
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
            self._shm_dir = None
        if self._owner >= 0:
            os.close(self._owner)  # the lock goes with it
            self._owner = -1


def _claimed_folder() -> tuple[str, int]:
    """A new region folder in /dev/shm and the fd of its locked ``OWNER_LOCK``. The folder
    gets its name only once locked, so a sweep never sees it unlocked while its owner lives."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    making = os.path.join(SHM_ROOT, f".{SHM_PREFIX}-making-{tag}")
    os.makedirs(making, mode=0o700)
    owner = os.open(os.path.join(making, OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(owner, fcntl.LOCK_EX)
    root = os.path.join(SHM_ROOT, f"{SHM_PREFIX}-{tag}")
    os.rename(making, root)
    return root, owner


def sweep_stale_shm() -> int:
    """Remove shared regions left in /dev/shm by processes that died; returns how many.

    A region is dead when nobody holds its ``OWNER_LOCK`` (the kernel drops a lock with its
    process, in whatever PID namespace: /dev/shm may be shared by containers, where the pid
    in a name means nothing). A folder without the lock file is never removed."""
    removed = 0
    try:
        names = os.listdir(SHM_ROOT)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != SHM_PREFIX or not parts[1].isdigit():
            continue
        root = os.path.join(SHM_ROOT, name)
        try:
            fd = os.open(os.path.join(root, OWNER_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # not ours to judge (or another user's)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        removed += 1
    return removed
