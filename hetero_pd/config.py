"""EngineConfig: the one typed object that configures an engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from backends import DtypeChoice, backend_for, parse_device
from hetero_pd import envs
from hetero_pd.engine.kv_tiers.config import TierConfig
from hetero_pd.engine.scheduler import ROLES, Role
from hetero_pd.engine.spec.config import SpeculativeConfig
from transfer.kv_layouts import LAYOUTS as KV_LAYOUTS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: What `dtype` accepts: "auto" lets the device's backend choose (see `resolve_dtype`).
DTYPE_CHOICES = ("auto", *DTYPES)
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
COMPILE_MODES = ("auto", "on", "off")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A concrete dtype from its name or alias; "auto" needs a device: `resolve_dtype`."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype == "auto":
        raise ValueError("dtype 'auto' depends on the device: use resolve_dtype(dtype, device)")
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    return DTYPES[name]


def resolve_dtype(
    dtype: str | torch.dtype, device: str | torch.device, checkpoint: str | None = None
) -> DtypeChoice:
    """The dtype an engine on `device` computes in: the named one, or for "auto" the one
    the device's backend picks for a checkpoint saved in `checkpoint` (see backends.dtype:
    half precision where the device runs it natively and faster, else float32), unless
    $HETERO_PD_AUTO_DTYPE forces it (envs.auto_dtype)."""
    if dtype == "auto":
        forced = envs.auto_dtype()
        if forced is not None:
            name = _DTYPE_ALIASES.get(forced, forced)
            if name not in DTYPES:
                raise ValueError(
                    f"HETERO_PD_AUTO_DTYPE must be one of {list(DTYPES)}, got {forced!r}"
                )
            return DtypeChoice(DTYPES[name], "auto: forced by HETERO_PD_AUTO_DTYPE")
        dev = parse_device(device)
        saved = parse_dtype(checkpoint) if checkpoint else None
        return backend_for(dev).auto_dtype(dev, saved)
    return DtypeChoice(parse_dtype(dtype), "configured")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs one model on one device.

    `kv_cache_gb` sizes the KV cache; `num_kv_blocks` overrides it with an exact count.
    `max_model_len` defaults to the model's limit, capped at 4096 (and at its sliding window).
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    role: Role = "both"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Prefix-cache tiers below the device KV (0 = off): host DRAM, then an SSD folder.
    kv_cache_host_gb: float = 0.0
    kv_cache_disk_gb: float = 0.0
    kv_cache_disk_path: str | None = None
    kv_cache_admit_after: int = 2  # uses (computed or hit) before a block goes down
    num_threads: int | None = None
    # Threads to start with, when fewer than `num_threads` (workers sharing one host's CPUs
    # start at their fair share); the thread governor (backends/cpu_share.py) then runs up
    # to `num_threads` while the CPUs are idle. None: `num_threads`.
    initial_threads: int | None = None
    seed: int = 0
    # Decode steps through the device's compiler (see backends.compiler): "auto" where the
    # backend measured that it pays, "on" (failing to compile is an error), "off" (eager).
    compile: str = "auto"
    # Edge split: > 0 makes a cloud engine that runs layers [start_layer, L) on hidden
    # states received from a device (prefix caching is then off: it never sees token ids).
    start_layer: int = 0
    # Byte order inside KV blocks (transfer/kv_layouts.py): "auto" = the device backend's
    # (`fractal_nz` on an NPU, `nd` elsewhere); a CPU engine set to "fractal_nz" emulates
    # an NPU worker's KV cache.
    kv_layout: str = "auto"
    # Ranks the model is split over (vLLM's name): one process per rank, each on its own
    # device (engine/tp/); rank 0 is the engine's own process.
    tensor_parallel_size: int = 1
    # Speculative decoding (vLLM's name and keys, as a SpeculativeConfig or its dict):
    # decode steps verify proposed tokens (hetero_pd/engine/spec/). None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.kv_layout not in ("auto", *KV_LAYOUTS):
            raise ValueError(
                f"kv_layout must be one of {('auto', *KV_LAYOUTS)}, got {self.kv_layout!r}"
            )
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        positive = ["block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gb"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.start_layer < 0:
            raise ValueError(f"start_layer must be >= 0, got {self.start_layer}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads", "initial_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        _ = self.kv_tiers  # rejects inconsistent kv_cache_* options now
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """Combinations tensor parallelism does not support yet, named."""
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return
        unsupported = {
            "start_layer > 0 (an edge split engine)": self.start_layer > 0,
            "compile 'on' (the decode step runs eager under TP)": self.compile == "on",
            "KV cache tiers (kv_cache_host_gb / kv_cache_disk_gb)": self.kv_tiers is not None,
            # A prefill or decode worker's ranks share one whole-head KV cache in /dev/shm.
            f"role {self.role!r} off the CPU (its ranks' KV heads must share memory)": (
                self.role != "both" and parse_device(self.device).type != "cpu"
            ),
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"tensor_parallel_size {tp} does not support {what} yet")

    @property
    def kv_tiers(self) -> TierConfig | None:
        """The prefix-cache tiers asked for by the `kv_cache_*` options, or None."""
        caching = self.enable_prefix_caching and self.start_layer == 0
        return TierConfig.from_options(
            self.kv_cache_host_gb,
            self.kv_cache_disk_gb,
            self.kv_cache_disk_path,
            caching,
            self.kv_cache_admit_after,
        )

    def dtype_choice(self, checkpoint: str | None = None) -> DtypeChoice:
        """`dtype` resolved on `device` for a checkpoint saved in `checkpoint`, with the
        reason ("configured" unless auto)."""
        return resolve_dtype(self.dtype, self.device, checkpoint)

    def kv_layout_choice(self) -> str:
        """`kv_layout`, with "auto" resolved by the device's backend."""
        if self.kv_layout != "auto":
            return self.kv_layout
        return backend_for(parse_device(self.device)).kv_layout

    def compile_choice(self) -> tuple[bool | None, str]:
        """(compile the decode step?, why): `compile`, with "auto" overridden by
        $HETERO_PD_COMPILE when set, else None: the device's backend decides once the engine
        knows whether its decode-attention kernel runs (`Backend.compile_by_default`)."""
        if self.compile != "auto":
            return self.compile == "on", "configured"
        if self.tensor_parallel_size > 1:
            return False, "tensor parallel: eager"
        env = envs.compile_mode()
        if env is not None:
            return env == "on", "HETERO_PD_COMPILE"
        return None, f"auto on {backend_for(parse_device(self.device)).kind}"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Builds a config, rejecting unknown keyword arguments by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; allowed: {sorted(names - {'model'})}"
            )
        if isinstance(kwargs.get("dtype"), torch.dtype):
            dtype = parse_dtype(kwargs["dtype"])  # a clear error for an unsupported dtype
            kwargs["dtype"] = next(k for k, v in DTYPES.items() if v == dtype)
        return cls(model=str(model), **kwargs)
