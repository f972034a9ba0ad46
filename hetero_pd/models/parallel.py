"""Tensor parallelism inside one model: which slice of each weight a rank holds, and the
collectives that join the slices (Megatron's split, as vLLM's `parallel_state` does it).

::

    embed_tokens   vocab-parallel: rank r holds rows [r*V/tp, (r+1)*V/tp); ids elsewhere
                   give 0 rows, an all-reduce sums them into every rank's hidden states
    qkv_proj       column-parallel by heads: rank r's query heads and the KV heads they
                   read (a KV head is replicated when tp > num_kv_heads)
    o_proj         row-parallel: the columns of rank r's heads; all-reduce after
    gate_up_proj   column-parallel; down_proj row-parallel, all-reduce after
    MoE experts    rank r holds experts [r*E/tp, (r+1)*E/tp) whole; all-reduce after
    shared experts (DeepSeek) column/row-parallel as an MLP, reduced with the routed ones
    lm_head        vocab-parallel; the logits gathered on rank 0, where sampling runs
    norms, router  replicated

MLA (DeepSeek-V3, mla.py) splits its heads, not its latent: q_proj / q_b_proj and kv_b_proj
are column-parallel by heads, o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa and their
norms are replicated, because the latent KV they make has no heads: every head of every
rank reads all of it. So each rank computes and caches the whole latent (vLLM's MLA under
TP does the same), identical on every rank: the same input rows (whole after each
all-reduce) through the same replicated weights and kernels.

A row-parallel layer's bias is added once: rank 0 holds it, the other ranks zeros.
The hidden states between layers are whole on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero_pd.models.config import ModelConfig, ModelConfigError


@dataclass(frozen=True)
class Parallel:
    """One rank's place in a tensor-parallel group; `group` None when size is 1."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; x itself when the model is not split."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, V/tp] on each rank -> [rows, V] on rank 0 (the others get their own)."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else logits


SINGLE = Parallel()


def kv_head_range(cfg: ModelConfig, size: int, rank: int) -> range:
    """The model's KV heads rank `rank` of `size` holds: a 1/size share, or the one head its
    query heads read when size exceeds the KV head count (then each head is on
    size / num_kv_heads ranks)."""
    kv = cfg.num_kv_heads
    if kv >= size:
        per = kv // size
        return range(rank * per, (rank + 1) * per)
    head = rank * kv // size
    return range(head, head + 1)


#: The families whose layers this module splits.
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")


def check_split(cfg: ModelConfig, size: int) -> None:
    """Raises ModelConfigError naming the first size this model cannot split `size` ways."""
    if size < 1:
        raise ModelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size > 1 and cfg.family not in TP_FAMILIES:
        raise ModelConfigError(
            f"tensor parallelism is not supported for {cfg.architecture} yet "
            f"(supported: {', '.join(TP_FAMILIES)})"
        )
    kv = cfg.num_kv_heads
    need = [
        ("num_attention_heads", cfg.num_heads),
        ("vocab_size", cfg.vocab_size),
        ("intermediate_size", cfg.intermediate_size),
    ]
    if cfg.num_experts:
        need.append(("num_experts", cfg.num_experts))
    if cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        need.append(("shared experts' intermediate size", shared))
    for name, value in need:
        if value % size:
            raise ModelConfigError(
                f"tensor_parallel_size {size} does not divide the model's {name} ({value})"
            )
    if (kv % size if kv >= size else size % kv) != 0:
        raise ModelConfigError(
            f"tensor_parallel_size {size} and num_key_value_heads {kv}: one must divide the "
            "other (KV heads are split, or each replicated on size / heads ranks)"
        )


def shard_config(cfg: ModelConfig, tp: Parallel) -> ModelConfig:
    """The shapes one rank's model has: its share of heads, MLP columns and vocabulary
    (experts stay counted whole: the router scores all of them)."""
    if tp.size == 1:
        return cfg
    check_split(cfg, tp.size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp.size,
        num_kv_heads=len(kv_head_range(cfg, tp.size, tp.rank)),
        intermediate_size=cfg.intermediate_size // tp.size,
        vocab_size=cfg.vocab_size // tp.size,
    )


def local_experts(cfg: ModelConfig, tp: Parallel) -> range:
    """The experts (global indices) rank tp.rank holds."""
    per = cfg.num_experts // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


@dataclass(frozen=True, slots=True)
class Take:
    """What a rank reads of one checkpoint tensor: rows/columns [start, stop) along `dim`
    (dim None: all of it), nothing (`skip`), or zeros of its shape (`zeros`)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    skip: bool = False
    zeros: bool = False

    def read(self, f: Any, name: str) -> torch.Tensor:
        """The slice from an open `safe_open` file, without reading the rest."""
        if self.dim is None and not self.zeros:
            whole: torch.Tensor = f.get_tensor(name)
            return whole
        part = f.get_slice(name)
        if self.zeros or self.dim is None:
            dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
            return torch.zeros(part.get_shape(), dtype=dtype)
        index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
        sliced: torch.Tensor = part[index]
        return sliced


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
ALL = Take()


def take(cfg: ModelConfig, tp: Parallel, target: str, shard: int | None) -> Take:
    """What rank tp.rank reads of the checkpoint tensor loaded into our parameter `target`
    (`shard` as the loader numbers fused and stacked parts); cfg is the whole model's."""
    if tp.size == 1:
        return ALL
    r, size = tp.rank, tp.size
    if target in ("embed_tokens.weight", "lm_head.weight"):
        per = cfg.vocab_size // size
        return Take(0, r * per, (r + 1) * per)
    module = target.rsplit(".", 2)[-2] if target.count(".") >= 2 else ""
    if ".experts_" in target:
        expert = (shard or 0) // 2
        return ALL if expert in local_experts(cfg, tp) else Take(skip=True)
    if cfg.mla is not None and ".self_attn." in target:
        return _take_mla(cfg, r, size, module)
    if ".shared_experts." in target:
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts // size
        return Take(0 if module == "gate_up_proj" else 1, r * inter, (r + 1) * inter)
    heads = cfg.num_heads // size * cfg.head_dim
    if module == "qkv_proj":
        if shard == 0:
            return Take(0, r * heads, (r + 1) * heads)
        kv = kv_head_range(cfg, size, r)
        return Take(0, kv.start * cfg.head_dim, kv.stop * cfg.head_dim)
    if module == "o_proj":
        if target.endswith(".bias"):
            return ALL if r == 0 else Take(zeros=True)
        return Take(1, r * heads, (r + 1) * heads)
    inter = cfg.intermediate_size // size
    if module == "gate_up_proj":
        return Take(0, r * inter, (r + 1) * inter)
    if module == "down_proj" and ".mlp." in target:
        return Take(1, r * inter, (r + 1) * inter)
    return ALL


def _take_mla(cfg: ModelConfig, r: int, size: int, module: str) -> Take:
    """MLA's slices: rank r's heads of the per-head projections, the latent's whole."""
    assert cfg.mla is not None
    m, heads = cfg.mla, cfg.num_heads // size
    per_head = {
        "q_proj": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "q_b_proj": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim,
    }
    if module in per_head:
        rows = heads * per_head[module]
        return Take(0, r * rows, (r + 1) * rows)
    if module == "o_proj":
        return Take(1, r * heads * m.v_head_dim, (r + 1) * heads * m.v_head_dim)
    return ALL  # q_a_proj, kv_a_proj_with_mqa and their norms: the latent is every head's


class VocabParallelEmbedding(nn.Embedding):
    """Rank r's rows [first, first + rows) of the embedding; the lookup's all-reduce makes
    each token's row whole on every rank."""

    def __init__(self, rows: int, dim: int, weight: torch.Tensor, tp: Parallel) -> None:
        super().__init__(rows, dim, _weight=weight)
        self.tp, self.first = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = super().forward(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill_(outside[:, None], 0))
