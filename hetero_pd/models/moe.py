"""Mixture of experts (Mixtral, Qwen3-MoE): a softmax router picks each token's top-k
experts, each expert a SwiGLU MLP; the token's output is the weighted sum of theirs.

Execution groups tokens by expert, never loops over tokens::

    topk ids   [N, k] --flatten, stable sort--> order [N*k]  (expert 0's rows first, ...)
    x[order // k]      -> rows of expert 0 | rows of expert 1 | ...   (one gather)
    each expert's slice -> gate_up, silu * up, down                    (one matmul pair each)
    y * weight         -> index_add into out[token]                    (one scatter)

Checkpoints store each expert's three matrices apart (`experts.{e}.w1/w3/w2` in Mixtral,
`experts.{e}.gate_proj/up_proj/down_proj` in Qwen3-MoE); the loader copies them into the
stacked parameters here (`expert_target`, `expert_slice`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.parallel import SINGLE, Parallel, local_experts

# checkpoint expert matrix -> (our stacked parameter, part: 0 gate, 1 up; 0 for down)
_EXPERT_PARTS = {
    "w1": ("experts_gate_up", 0),
    "w3": ("experts_gate_up", 1),
    "w2": ("experts_down", 0),
    "gate_proj": ("experts_gate_up", 0),
    "up_proj": ("experts_gate_up", 1),
    "down_proj": ("experts_down", 0),
}
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
#: Each family's checkpoint names: (block, gate, up, down).
_CHECKPOINT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class SparseMoE(nn.Module):
    """The MoE block that replaces a decoder layer's MLP. Under tensor parallelism a rank
    holds its share of the experts whole (parallel.local_experts); an all-reduce sums the
    ranks' contributions."""

    def __init__(self, cfg: ModelConfig, tp: Parallel = SINGLE) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.tp, held = tp, local_experts(cfg, tp)
        self.first_expert, experts = held.start, len(held)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)  # the router
        # experts_gate_up: [experts, 2 * inter, hidden] (gate rows, then up rows)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        y = sparse_moe(
            x,
            self.gate.weight,
            self.experts_gate_up,
            self.experts_down,
            self.top_k,
            self.norm_topk_prob,
            self.first_expert,
        )
        return self.tp.all_reduce(y)


# An op the compiler does not trace (as `hetero_pd::linear`): the expert sizes are data (a
# host sync), and a graph traced through them would break, or be specialised to one step's
# routing. A compiled decode layer calls it as one node; a backend's fused kernel can too.
@torch.library.custom_op("hetero_pd::sparse_moe", mutates_args=())
def sparse_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [N, hidden], router [experts, hidden], gate_up [held, 2 * inter, hidden],
    down [held, hidden, inter] -> [N, hidden]: the contributions of the `held` experts
    from `first_expert` on (all of them unless the experts are split over ranks)."""
    probs = F.softmax(F.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.flatten()
    # Stable: within an expert, rows keep token order, so each token's contributions are
    # summed in expert order (as transformers does).
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=router.shape[0]).tolist()
    held = counts[first_expert : first_expert + down.shape[0]]
    lo = sum(counts[:first_expert])
    order = order[lo : lo + sum(held)]  # the rows of the held experts
    if not len(order):
        return torch.zeros_like(x)
    tokens = order // top_k
    rows = x[tokens]
    outs, start = [], 0
    for expert, count in enumerate(held):
        if count == 0:
            continue
        h = F.linear(rows[start : start + count], gate_up[expert])
        gate, up = h.chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[expert]))
        start += count
    y = torch.cat(outs) * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


@sparse_moe.register_fake
def _(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    first_expert: int = 0,
) -> torch.Tensor:
    return torch.empty_like(x)


def expert_target(rest: str) -> tuple[str, int] | None:
    """A layer's checkpoint sub-name (`mlp.experts.3.up_proj.weight`) -> (our parameter
    inside the layer, shard = expert * 2 + part), or None if it is no expert matrix."""
    m = _EXPERT.match(rest)
    if m is None or m.group(2) not in _EXPERT_PARTS:
        return None
    param, part = _EXPERT_PARTS[m.group(2)]
    return f"mlp.{param}", int(m.group(1)) * 2 + part


def expert_slice(cfg: ModelConfig, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
    """The view of stacked parameter `name` that shard `shard` (see expert_target) fills."""
    expert, part = divmod(shard, 2)
    if name.endswith("experts_down"):
        return param[expert]
    inter = cfg.moe_intermediate_size
    return param[expert].narrow(0, part * inter, inter)


def missing_expert_tensors(
    cfg: ModelConfig, layer: str, param: str, filled: set[int | None]
) -> list[str]:
    """Checkpoint names of the expert matrices stacked parameter `param` still lacks."""
    block, gate, up, down = _CHECKPOINT_NAMES[cfg.family]
    parts = [(down, 0)] if param.endswith("experts_down") else [(gate, 0), (up, 1)]
    return [
        f"model.layers.{layer}.{block}.experts.{e}.{kind}.weight"
        for e in range(cfg.num_experts)
        for kind, part in parts
        if e * 2 + part not in filled
    ]


def router_target(rest: str) -> str | None:
    """Mixtral's router `block_sparse_moe.gate.weight` -> our `mlp.gate.weight`."""
    return "mlp.gate.weight" if rest == "block_sparse_moe.gate.weight" else None
