"""Builds an engine's model runner: the model (this rank's shard under tensor parallelism),
its KV cache sized by the budget, and the other tensor-parallel ranks when there are some."""

from __future__ import annotations

from pathlib import Path

import torch

from backends import Backend, backend_for, parse_device
from backends.cpu_share import ThreadGovernor
from hetero_pd import envs
from hetero_pd.config import EngineConfig
from hetero_pd.engine.model_runner import KVAllocator, ModelRunner, compiled_code_dir
from hetero_pd.engine.tp.group import RankGroup, start_ranks
from hetero_pd.engine.tp.kv import head_slices, shared_files
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM
from hetero_pd.models.loader import load_model
from hetero_pd.models.parallel import SINGLE, Parallel, shard_config
from transfer.kv_layouts import ND

MAX_DEFAULT_MODEL_LEN = 4096


def max_model_len(config: EngineConfig, cfg: ModelConfig, model_path: Path) -> int:
    """The engine's max_model_len: the configured one, checked against what the model
    supports, else that limit capped at MAX_DEFAULT_MODEL_LEN."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        # Positions never leave the window, so the model's sliding attention is exact.
        limit = min(limit, cfg.sliding_window)
    if config.max_model_len is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds what {model_path} supports ({limit})"
        )
    return config.max_model_len


def rank_threads(config: EngineConfig, backend: Backend) -> int:
    """Torch threads per rank: the configured count, else the backend's default (0: torch's
    own) shared among the tensor-parallel ranks."""
    default = backend.default_threads()
    tp = config.tensor_parallel_size
    return config.num_threads or envs.num_threads() or (default and max(1, default // tp))


def thread_governor(
    config: EngineConfig, device: torch.device, backend: Backend
) -> ThreadGovernor | None:
    """Sets the threads a CPU engine starts with (`initial_threads`, else all of its
    threads) and returns what moves them with the load: fewer while other processes keep
    its CPUs busy, more (up to its threads) while they idle (backends/cpu_share.py; a
    compiled CPU step follows too: CpuBackend.compile_step's dynamic OpenMP threads). None:
    a fixed count (one thread, tensor parallel, or $HETERO_PD_ADAPTIVE_THREADS=0)."""
    threads = rank_threads(config, backend)
    adaptive = device.type == "cpu" and (threads or 0) > 1 and envs.adaptive_threads()
    adaptive = adaptive and config.tensor_parallel_size == 1
    start = min(config.initial_threads or threads or 0, threads or 0) or None
    if start:
        torch.set_num_threads(start)
    return ThreadGovernor(threads, start) if adaptive else None


def use_backend_kernels(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """The device backend's norm, linear and MoE kernels in `model`. Every tensor-parallel rank
    takes the same ones: the ranks then compute their replicated parts (KV heads shared by
    ranks, MLA's latent) to the same bits, which the shared KV cache relies on (tp/kv.py)."""
    backend = backend_for(device)
    kernel_dir = compiled_code_dir("kernels")
    if envs.native_norm() and backend.native_rms_norm(dtype, kernel_dir):
        model.use_norm_kernel()
    model.use_linear_kernels(backend.linear_kernel)
    model.use_moe_kernel(backend.moe_kernel(dtype))


def blocks_for_budget(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV blocks `config.kv_cache_gb` holds for a model of `cfg`'s shapes (one rank's)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = config.block_size * cfg.kv_bytes_per_token * elem
    num_blocks = int(config.kv_cache_gb * 2**30) // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds no KV block")
    return num_blocks


def shared_kv(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    kv_allocator: KVAllocator,
) -> tuple[KVAllocator, list[str]]:
    """A worker's KV under TP on the CPU: every head allocated by `kv_allocator` (the
    worker's transfer region, in shared memory), as (rank 0's allocator of its heads, the
    files the other ranks map); see tp/kv.py."""
    layout = config.kv_layout_choice()
    if layout != ND:
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} on the CPU slices each rank's "
            f"KV heads out of one nd cache; kv_layout {layout!r} cannot be sliced by head"
        )
    # Under TP the step runs eager: the pool and the null block, no scratch block.
    block_shape = cfg.kv_block_shape(config.block_size)
    per_layer = cfg.kv_tensors_per_layer
    whole = kv_allocator(cfg.num_layers, num_blocks + 1, block_shape, dtype, device, per_layer)
    tp = Parallel(0, config.tensor_parallel_size)
    return head_slices(cfg, tp, whole), shared_files(whole)


def load_runner(
    config: EngineConfig,
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    compile_step: bool | None,
    kv_allocator: KVAllocator | None,
) -> tuple[ModelRunner, RankGroup | None, int]:
    """(runner, the other ranks or None, KV blocks per rank) for `config`'s engine."""
    device = parse_device(config.device)
    tp = config.tensor_parallel_size
    # Each rank's shapes (its heads, MLP columns, vocabulary); cfg itself when tp is 1.
    local = shard_config(cfg, Parallel(0, tp))
    num_blocks = config.num_kv_blocks or blocks_for_budget(config, local, dtype)
    if not 0 <= config.start_layer < cfg.num_layers:
        raise ValueError(
            f"start_layer={config.start_layer} is outside the model's {cfg.num_layers} layers"
        )
    files: list[str] = []
    if tp > 1 and kv_allocator is not None and device.type == "cpu":
        kv_allocator, files = shared_kv(config, cfg, dtype, device, num_blocks, kv_allocator)
    ranks = None
    if tp > 1:
        ranks = start_ranks(config, str(path), dtype, num_blocks, max_model_len, files)
    try:
        parallel = SINGLE if ranks is None else ranks.parallel
        model = load_model(path, cfg, dtype, device, max_model_len, parallel)
        use_backend_kernels(model, device, dtype)
        runner = ModelRunner(
            model,
            local,
            num_blocks,
            config.block_size,
            device,
            dtype,
            kv_allocator,
            config.start_layer,
            compile=compile_step,
            compile_required=config.compile == "on",
            kv_layout=config.kv_layout_choice(),
            ranks=ranks,
        )
        if ranks is not None:
            ranks.wait_loaded()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    return runner, ranks, num_blocks
