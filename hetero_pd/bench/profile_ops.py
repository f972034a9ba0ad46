"""What `hetero-pd bench profile` counts: the GEMM rate on a model's own projection shapes,
the model FLOPs of a step, and a profiled step's self CPU time grouped into categories.

Categories (shares of the step's wall time; they sum to 1):

- ``gemm``: matmuls (aten::mm/addmm/bmm, oneDNN's packed linear, the `hetero_pd::linear` op);
- ``attention``: SDPA, the C paged-decode kernel, MoE expert kernels;
- ``elementwise``: norms, rope, activations, residual adds (aten math ops in the model, and
  inductor's fused loops, profiled by name with `cpp.enable_kernel_profile`);
- ``copies``: copies and casts (aten::copy_/to/_to_copy), KV cache writes and gathers;
- ``sampling``: every op under the sampler (`sample_runs`), whatever its name;
- ``other_ops``: views, allocations and ops outside the model (the scheduler's inputs);
- ``overhead``: Python and scheduling, the wall time no op accounts for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetero_pd.models.config import ModelConfig

#: The scope the bench opens around the sampler, so its ops count as sampling.
SAMPLING_SCOPE = "hetero_pd.sampling"
CATEGORIES = (
    "gemm",
    "attention",
    "elementwise",
    "copies",
    "sampling",
    "other_ops",
    "overhead",
)
_GEMM = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_addmm_activation",
    "mkldnn::_linear_pointwise",
    "hetero_pd::linear",
}
_COPIES = {
    "aten::copy_",
    "aten::to",
    "aten::_to_copy",
    "aten::clone",
    "aten::contiguous",
    "aten::index_copy_",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::index_select",
    "aten::index",
    "aten::embedding",
    "aten::cat",
    "aten::stack",
}
_OTHER = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::as_strided",
    "aten::slice",
    "aten::select",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::narrow",
    "aten::unbind",
    "aten::detach",
    "aten::alias",
    "aten::resize_",
    "aten::lift_fresh",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::tensor",
    "aten::scalar_tensor",
    "aten::zeros",
    "aten::ones",
    "aten::full",
    "aten::arange",
    "aten::fill_",
    "aten::zero_",
    "aten::set_",
}


def category(name: str) -> str:
    """The category of an op by name (sampling is decided by scope, not here)."""
    low = name.lower()
    if name in _GEMM:
        return "gemm"
    if any(word in low for word in ("attention", "paged_decode", "prefill_causal", "moe")):
        return "attention"
    if name in _COPIES:
        return "copies"
    if "cpp_fused" in low or "kernel_cpp" in low:
        return "elementwise"
    if name in _OTHER or not name.startswith(("aten::", "hetero_pd::", "mkldnn::")):
        return "other_ops"
    return "elementwise"


def _under_sampling(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == SAMPLING_SCOPE:
            return True
        parent = parent.cpu_parent
    return False


def breakdown(events: Iterable[Any], wall_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per category of one profiled stretch of `wall_s` seconds (events: the
    profiler's FunctionEvents), and seconds per op name. Only the profiled thread's ops
    count: the intra-op threads work inside them. Overhead is the wall time left over
    (never below zero)."""
    secs = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, float] = {}
    for e in events:
        kernel = e.is_user_annotation and e.name.startswith("hetero_pd::")  # a C kernel's call
        if (e.is_user_annotation and not kernel) or e.is_python_function:
            continue  # scopes: their self time is Python between ops, counted as overhead
        cat = "sampling" if _under_sampling(e) else category(e.name)
        secs[cat] += e.self_cpu_time_total / 1e6
        by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total / 1e6
    secs["overhead"] = max(0.0, wall_s - sum(secs.values()))
    return secs, by_name


def shares(secs: dict[str, float]) -> dict[str, float]:
    total = sum(secs.values()) or 1.0
    return {k: v / total for k, v in secs.items()}


def linear_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every linear layer (LM head included)."""
    return [
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def step_flops(
    cfg: ModelConfig,
    shapes: list[tuple[str, int, int]],
    prompts: list[tuple[int, int]],
    sampled_rows: int,
) -> float:
    """Model FLOPs of one step: 2 x weights x tokens over the layers' linears, 2 x the LM
    head's weights per sampled row, and attention (QK^T and PV, 4 x heads x head_dim per
    query-key pair). prompts: (new tokens, context before them) per sequence."""
    tokens = sum(n for n, _ in prompts)
    layer_params = sum(i * o for name, i, o in shapes if name != "lm_head")
    head = sum(i * o for name, i, o in shapes if name == "lm_head")
    # query i of a chunk (0-based) after `ctx` cached tokens attends to ctx + i + 1 keys
    pairs = sum(n * ctx + n * (n + 1) // 2 for n, ctx in prompts)
    attn = 4 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    return 2.0 * layer_params * tokens + 2.0 * head * sampled_rows + attn


def served_flops(
    cfg: ModelConfig,
    shapes: list[tuple[str, int, int]],
    requests: int,
    input_tokens: int,
    output_tokens: int,
) -> float:
    """Model FLOPs of a served run (`step_flops` summed over its work): `requests` prompts of
    input_tokens / requests tokens each prefilled, then each request's output tokens but the
    first (sampled at the end of its prefill) decoded one at a time over its growing
    context; the LM head on every output token. Requests of one length, as `bench serve`'s
    random dataset sends (other datasets: their mean lengths)."""
    if requests <= 0:
        return 0.0
    n_in, n_out = input_tokens / requests, output_tokens / requests
    prefill = step_flops(cfg, shapes, [(round(n_in), 0)], 0)
    steps = max(round(n_out) - 1, 0)
    decode = sum(step_flops(cfg, shapes, [(1, round(n_in) + i)], 0) for i in range(steps))
    head = step_flops(cfg, [s for s in shapes if s[0] == "lm_head"], [], 1)
    return requests * (prefill + decode) + output_tokens * head


def _median_s(run: Any, repeats: int) -> float:
    run()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


@torch.inference_mode()
def gemm_rate(
    shapes: list[tuple[str, int, int]], rows: int, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """GFLOP/s of the projections `shapes` at `rows` tokens in `dtype`, median of `repeats`:
    `F.linear` and oneDNN's packed linear (weight reordered once, as the CPU backend's
    float32 kernel runs), and the best. A shape that n layers have runs over n distinct
    weights, so that weights come from memory as in the model, not hot in cache."""
    counts: dict[tuple[int, int], int] = {}
    for _, i, o in shapes:
        counts[(i, o)] = counts.get((i, o), 0) + 1
    out: dict[str, float] = {}
    ways = ["linear"]
    if torch.backends.mkldnn.is_available():
        ways.append("packed")
    for way in ways:
        flops = seconds = 0.0
        for (i, o), n in counts.items():
            x = torch.randn(rows, i, dtype=dtype)
            ws = [torch.randn(o, i, dtype=dtype) for _ in range(n)]
            try:
                if way == "packed":
                    ws = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
                s = _median_s(lambda x=x, ws=ws, way=way: _linears(x, ws, way), repeats)
            except (RuntimeError, NotImplementedError):
                break
            flops += 2.0 * rows * i * o * n
            seconds += s
        else:
            out[way] = flops / seconds / 1e9
    out["best"] = max(out.values())
    return out


def _linears(x: torch.Tensor, weights: list[torch.Tensor], way: str) -> None:
    for w in weights:
        if way == "linear":
            F.linear(x, w)
        else:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
