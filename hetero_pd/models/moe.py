"""Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3): a router picks each token's top-k
experts, each expert a SwiGLU MLP; the token's output is the weighted sum of theirs (plus,
in DeepSeek-V3, its shared experts'). Routing: softmax top-k (`softmax_topk`) or DeepSeek's
sigmoid, score-corrected, group-limited top-k (`grouped_topk`).

Execution groups tokens by expert, never loops over tokens::

    topk ids   [N, k] --flatten, stable sort--> order [N*k]  (expert 0's rows first, ...)
    x[order // k]      -> rows of expert 0 | rows of expert 1 | ...   (one gather)
    each expert's slice -> gate_up, silu * up, down                    (one matmul pair each)
    y * weight         -> slots[order] = y, [N, k, hidden] summed over k  (one scatter, one sum)

Checkpoints store each expert's three matrices apart (`experts.{e}.w1/w3/w2` in Mixtral,
`experts.{e}.gate_proj/up_proj/down_proj` in Qwen3-MoE); the loader copies them into the
stacked parameters here (`expert_target`, `expert_slice`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from backends import MoEKernel
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
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class SparseMoE(nn.Module):
    """The MoE block that replaces a decoder layer's MLP (its routed experts; DeepSeek's
    shared experts are deepseek.py's). Under tensor parallelism a rank holds its share of
    the experts whole (parallel.local_experts); an all-reduce sums the ranks' contributions."""

    #: The backend's fused experts (Backend.moe_kernel), used by eager steps; None: grouped.
    kernel: MoEKernel | None = None

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
        self.sigmoid = cfg.moe_scoring == "sigmoid"
        if self.sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))
            self.groups = (cfg.n_group, cfg.topk_group)
            self.routed_scaling_factor = cfg.routed_scaling_factor
        #: DeepSeek's shared experts (an MLP every token takes), set by the model.
        self.shared_experts: nn.Module | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> each token's expert weights (float32) and ids, [N, top_k] each."""
        if not self.sigmoid:
            return softmax_topk(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob)
        return grouped_topk(
            F.linear(x.float(), self.gate.weight.float()),
            self.e_score_correction_bias.float(),
            self.top_k,
            *self.groups,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        weights, ids = self.route(x)
        run = moe_experts if torch.compiler.is_compiling() else (self.kernel or grouped_experts)
        experts, held = self.gate.weight.shape[0], (self.experts_gate_up, self.experts_down)
        y = run(x, weights, ids, *held, experts, self.first_expert)
        if self.shared_experts is not None:  # its partial sum under TP (deepseek.py)
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y)


def softmax_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen3-MoE's routing: the top-k of the softmax, renormalised if asked."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter, op for op): sigmoid scores;
    the experts are chosen by score + bias, but only from the `topk_group` groups whose two
    best experts score highest; their weights are the plain scores, renormalised if asked,
    times `scaling`. logits [N, experts] float32."""
    scores = logits.sigmoid()
    choice = scores + bias
    n, experts = choice.shape
    group_scores = choice.view(n, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(n, n_group, experts // n_group)
    choice = choice.masked_fill(~expert_mask.reshape(n, experts), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


#: Rows (tokens x top-k) from which the experts' outputs are summed by one index_add_.
INDEX_ADD_MIN_ROWS = 128


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    num_experts: int,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [N, hidden], weights and ids [N, k], gate_up [held, 2 * inter, hidden],
    down [held, hidden, inter] -> sum over k of weight * expert(x), [N, hidden]: the
    contributions of the `held` experts from `first_expert` on (all of them unless the
    experts are split over ranks)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    held = counts[first_expert : first_expert + down.shape[0]]
    lo = sum(counts[:first_expert])
    order = order[lo : lo + sum(held)]  # the rows of the held experts
    if not len(order):
        return torch.zeros_like(x)
    tokens = order // top_k
    rows = x[tokens]
    y = torch.empty_like(rows)  # each expert's output written in place: no cat
    start = 0
    for expert, count in enumerate(held):
        if count == 0:
            continue
        end = start + count
        h = F.linear(rows[start:end], gate_up[expert])
        gate, up = h.chunk(2, dim=-1)
        torch.mm(F.silu(gate) * up, down[expert].t(), out=y[start:end])
        start = end
    y = y * weights.flatten()[order, None]  # float32, as the weights (as transformers does)
    if len(order) >= INDEX_ADD_MIN_ROWS:  # a prefill chunk: one pass, ~7% faster at 512 rows
        out = y.new_zeros(x.shape)
        return out.index_add_(0, tokens, y).to(x.dtype)
    # A decode step's few rows: back to [token, k] slots, summed per token. Not index_add_:
    # it runs a parallel region even for one token's few rows, which on a busy 2-thread CPU
    # waits for the second thread (a decode step's MoE 0.8x transformers').
    held_all = len(order) == len(flat)
    slots = y.new_empty(len(flat), x.shape[1]) if held_all else y.new_zeros(len(flat), x.shape[1])
    slots[order] = y
    return slots.view(ids.shape[0], top_k, -1).sum(dim=1).to(x.dtype)


# An op the compiler does not trace (as `hetero_pd::linear`): the expert sizes are data (a
# host sync), and a graph traced through them would break, or be specialised to one step's
# routing. A compiled decode layer calls it as one node (routing, plain tensor ops, stays
# in the graph); a backend's fused kernel takes the same arguments (vLLM's fused_experts).
# Eager code calls `grouped_experts` itself: an op's first call imports torch._dynamo
# (3-4 s of a worker's first step).
moe_experts = torch.library.custom_op("hetero_pd::moe_experts", mutates_args=())(grouped_experts)


@moe_experts.register_fake
def _(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    num_experts: int,
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


#: Router tensors whose names differ from ours.
_ROUTER_NAMES = {
    "block_sparse_moe.gate.weight": "mlp.gate.weight",  # Mixtral
    "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias",  # DeepSeek-V3
}


def router_target(rest: str) -> str | None:
    """A router tensor's checkpoint sub-name -> ours (None: the same, or no router)."""
    return _ROUTER_NAMES.get(rest)


def router_checkpoint_name(cfg: ModelConfig, name: str) -> str:
    """Our full tensor name -> the checkpoint's, for the router tensors named apart."""
    for theirs, ours in _ROUTER_NAMES.items():
        if name.endswith(f".{ours}") and theirs.startswith(_CHECKPOINT_NAMES[cfg.family][0]):
            return name[: -len(ours)] + theirs
    return name
