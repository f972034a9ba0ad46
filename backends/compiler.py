"""How each device kind compiles the engine's decode step.

- cpu: inductor with the batch and context dimensions dynamic. One graph serves every batch
  size (from 2) and context length, so nothing is padded and compilation happens once; the
  generated C++ is cached.
- cuda: CUDA graphs (`torch.compile(mode="reduce-overhead")`). A graph replays fixed
  shapes, so the engine pads each decode batch to a bucket and its context to a multiple.
- npu: graph mode through torchair (Ascend's torch.compile backend) with the same padding.

The compiled callable is used for decode batches only; prefill stays eager.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from backends import native
from backends.errors import BackendUnavailableError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class StepPadding:
    """Static shapes for graph replay: a decode batch of n rows is padded to the smallest
    bucket >= n (batches above the largest run eager), its context to a multiple."""

    batch_buckets: tuple[int, ...]
    context_multiple: int

    def batch(self, n: int) -> int | None:
        """The padded batch size for n rows, or None when n exceeds every bucket."""
        return next((b for b in self.batch_buckets if b >= n), None)

    def context(self, n: int) -> int:
        """n rounded up to the context multiple."""
        return -(-n // self.context_multiple) * self.context_multiple


#: Buckets as vLLM captures them: 1, 2, 4, then every 8 up to 256; contexts by 512 (the
#: compiled attention reads every padded slot, masked, so coarser costs bandwidth).
GRAPH_PADDING = StepPadding((1, 2, 4, *range(8, 257, 8)), context_multiple=512)


def use_cache_dir(path: Path) -> None:
    """Keep inductor's generated code in `path` (unless the user set TORCHINDUCTOR_CACHE_DIR),
    so the next start loads it instead of compiling again. Inductor writes its default
    (/tmp/torchinductor_USER) into the variable the first time it looks, which is not the
    user's choice. Inductor unpickles and runs what its cache holds, so `path` is made ours
    and private (0700), and one that is not ours, or others may write (it or a folder above
    it, `native.check_private_folder`), is refused
    (`native.UntrustedKernel`), as a kernel library is."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        native.check_private_folder(path)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def inductor(fn: F, any_thread_count: bool = False) -> F:
    """`fn` compiled by inductor. Dimensions the caller marks dynamic before the first call
    (`torch._dynamo.mark_dynamic`) stay symbolic, the rest are specialized: one graph then
    serves every batch size and context length, with the model's own sizes baked in.

    `any_thread_count`: the graph is not tied to torch's thread count. Dynamo's global-state
    guard holds the thread count among grad mode, default dtype and autocast, so each count a
    thread governor sets would compile the step again (2 -> 1 threads added 2 graphs). Only
    for code whose kernels read the count when they run (inductor's `cpp.dynamic_threads`,
    whose cache key leaves it out for that reason) and that is always called in the same
    state otherwise (the engine's decode step: inference mode, default dtype, no autocast):
    the whole global-state guard is dropped, as dynamo has no finer switch."""
    if not any_thread_count:
        return cast(F, torch.compile(fn, backend="inductor"))
    options: dict[str, str | int | bool | Callable[..., Any]] = {
        "guard_filter_fn": _all_but_global_state
    }
    return cast(F, torch.compile(fn, backend="inductor", options=options))


def _all_but_global_state(guards: Sequence[Any]) -> list[bool]:
    """Keeps every guard dynamo made except GLOBAL_STATE (a `guard_filter_fn`)."""
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


def _allow_graph_per_shape() -> None:
    """One graph per (bucket, context) shape: more than dynamo's default of 8 per function."""
    shapes = len(GRAPH_PADDING.batch_buckets) * 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes)
    limit = torch._dynamo.config.accumulated_recompile_limit
    torch._dynamo.config.accumulated_recompile_limit = max(limit, 2 * shapes)


def cuda_graphs(fn: F) -> F:
    """`fn` compiled by inductor and replayed as CUDA graphs, one per padded shape."""
    _allow_graph_per_shape()
    return cast(F, torch.compile(fn, mode="reduce-overhead", dynamic=False))


def npu_graph(fn: F) -> F:
    """`fn` compiled in Ascend graph mode through torchair, one graph per padded shape."""

    try:
        import torchair
    except ImportError as exc:
        raise BackendUnavailableError(
            "NPU graph mode needs torchair (shipped with torch_npu 2.1+); "
            "install it or set compile: off"
        ) from exc
    _allow_graph_per_shape()
    backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    return cast(F, torch.compile(fn, backend=backend, dynamic=False))
