"""The Llama family (llama, mistral, qwen2, qwen3; with moe.py's experts, mixtral and
qwen3_moe) over a paged KV cache, runnable by layer range."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backends import LinearKernel, MoEKernel, rms_norm
from hetero_pd.models.attention import AttentionMetadata, paged_attention
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.moe import SparseMoE
from hetero_pd.models.parallel import SINGLE, Parallel, VocabParallelEmbedding
from hetero_pd.models.rotary import apply_rope_swapped, rope_table, signed_sin

# One layer's KV tensors: (K, V), or MLA's (latent,) (ModelConfig.kv_block_shape).
KVCache = tuple[torch.Tensor, ...]
# (weight, bias) -> a faster x -> F.linear(x, weight, bias), or None: Backend.linear_kernel
LinearKernelFactory = Callable[[torch.Tensor, torch.Tensor | None], LinearKernel | None]
# (layer, h, cos, sin_signed, kv, meta) -> h: one decoder layer, eager or compiled
LayerStep = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, KVCache, AttentionMetadata],
    torch.Tensor,
]

# Linear layers with a device kernel, by handle: a compiled graph calls the kernel through
# the `hetero_pd::linear` op with the layer's handle (its kernel holds an opaque pre-packed
# weight no compiler can trace). Weak, so a freed model leaves no kernels behind.
_KERNEL_LAYERS: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("hetero_pd::linear", mutates_args=())
def kernel_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """`Linear` number `handle`'s kernel on x [rows, in_features]."""
    kernel = _KERNEL_LAYERS[int(handle)].kernel
    assert kernel is not None
    return kernel(x)


@kernel_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


class Linear(nn.Linear):
    """nn.Linear that can hand its matmul to a device kernel (`use_kernel`)."""

    kernel: LinearKernel | None = None
    handle: torch.Tensor  # a buffer, so one compiled layer serves every layer's kernels

    def use_kernel(self, make: LinearKernelFactory, keep_weight: bool) -> None:
        """Routes forward through `make(weight, bias)` unless that is None. Without
        `keep_weight` the dense weight is dropped (the kernel holds its own copy)."""
        kernel = make(self.weight, self.bias)
        if kernel is None:
            return
        self.kernel = kernel
        handle = next(_handles)
        _KERNEL_LAYERS[handle] = self
        self.register_buffer("handle", torch.tensor(handle), persistent=False)
        if not keep_weight:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return kernel_linear(x, self.handle, self.out_features)
        return self.kernel(x)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm; with `native` (CausalLM.use_norm_kernel) by the CPU
    kernel of backends/rms_norm.py, the same roundings in one pass and no float32 copy."""

    native = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            if torch.compiler.is_compiling():
                return rms_norm.rms_norm_op(x, self.weight, self.eps)
            return rms_norm.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s), s) for s = x + residual; x is the caller's own (it may hold s after)."""
        if self.native:
            if torch.compiler.is_compiling():
                out, s = rms_norm.add_rms_norm_op(x, residual, self.weight, self.eps)
                return out, s
            return rms_norm.add_rms_norm(x, residual, self.weight, self.eps)
        s = x.add_(residual)
        return self(s), s


class Attention(nn.Module):
    """cfg: this rank's shapes (parallel.shard_config); o_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: Parallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5
        # Qwen3: RMSNorm over each head's head_dim, on q and k before rope.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim], normalised
        per head where the model says so (else returned as they are)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        # Rotary on q and k together: qk [num_tokens, heads + kv_heads, head_dim]
        qk = qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, dim)
        if self.q_norm is not None:
            qk = torch.cat(self.norm_heads(*qk.split([heads, kv_heads], dim=1)), dim=1)
        q, k = apply_rope_swapped(qk, cos, sin_signed).split([heads, kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, kv_heads, dim)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.view(-1, self.num_heads * self.head_dim)))


class MLP(nn.Module):
    """SwiGLU; under TP column- then row-parallel, its output summed over the ranks unless
    `reduce` is False (the caller sums it with other partial results)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: Parallel = SINGLE,
        intermediate_size: int | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp if reduce else SINGLE
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate).mul_(up)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: Parallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.feed_forward(cfg, index, tp)

    def attention(self, cfg: ModelConfig, tp: Parallel) -> nn.Module:
        """The attention block (a family with another kind overrides this)."""
        return Attention(cfg, tp)

    def feed_forward(self, cfg: ModelConfig, index: int, tp: Parallel) -> nn.Module:
        """Layer `index`'s MLP or MoE block."""
        return SparseMoE(cfg, tp) if index in cfg.moe_layers else MLP(cfg, tp)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos, sin_signed: [num_tokens, 1, head_dim], see rotary.apply_rope_swapped."""
        # Residual adds in place into the sublayers' fresh outputs (never into x, which may
        # be the caller's hidden states).
        a = self.self_attn(self.input_layernorm(x), cos, sin_signed, kv, meta)
        h, x = self.post_attention_layernorm.add(a, x)
        return self.mlp(h).add_(x)


class CausalLM(nn.Module):
    """Decoder-only LM. `forward` runs layers [start, end) on a flat token batch.

    Layer 0 takes token ids, any later start layer takes hidden states [num_tokens, hidden];
    the output is the hidden state after layer `end - 1` (before the final norm), so
    running [0, k) then [k, L) equals running [0, L).

    Under tensor parallelism (`tp`, parallel.py) cfg holds this rank's shapes.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: Parallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # No random init: `load_model` builds this on the meta device and fills every weight
        # from the checkpoint, and `normal_` on meta alone imports torch's Python
        # decompositions (1-2.5 s of every worker's start).
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, embed, tp)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.cos_sin = torch.empty(0)  # set by init_rope() once the model is on its device
        # Set by compile_decode(): the decoder layer and the logits, compiled.
        self.compiled_layer: LayerStep | None = None
        self.compiled_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.dynamic_batch = False

    def make_layer(self, cfg: ModelConfig, index: int, tp: Parallel) -> nn.Module:
        """Decoder layer `index` (a family with other layers overrides this)."""
        return DecoderLayer(cfg, index, tp)

    def init_rope(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """The rope table for every position, [max_positions, 2, head_dim]: cos and
        `signed_sin(sin)`, cast once to the compute `dtype` (casting the float32 values per
        step, as transformers does, gives the same bits; negating is exact)."""
        cs = rope_table(self.cfg, self.max_positions)
        cs[:, 1] = signed_sin(cs[:, 1])
        self.cos_sin = cs.to(device=device, dtype=dtype)

    def use_linear_kernels(self, make: LinearKernelFactory) -> None:
        """Runs every linear layer through `make`'s kernels (e.g. `backend.linear_kernel`).

        Call once the weights are loaded, cast and on their device. The dense weights of
        the kernels' layers are freed, except the LM head's when it is tied to the
        embedding; this model's state_dict then no longer holds them.
        """
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                tied = name == "lm_head" and self.cfg.tie_word_embeddings
                module.use_kernel(make, keep_weight=tied)

    def use_norm_kernel(self) -> None:
        """Runs every RMSNorm through backends/rms_norm.py's kernel (call once its
        `available` said yes for the model's dtype)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = True

    def use_moe_kernel(self, kernel: MoEKernel | None) -> None:
        """Runs every MoE layer's routed experts through `kernel` (e.g. the backend's
        `moe_kernel(dtype)`) in eager steps; None keeps the grouped path."""
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.kernel = kernel

    def compile_decode(
        self, compile_fn: Callable[[Callable[..., torch.Tensor]], object], dynamic_batch: bool
    ) -> None:
        """Compiles one decoder layer (a single graph that every layer reuses: their weights
        are its inputs) and the logits with `compile_fn` (e.g. a backend's `compile_step`),
        for `forward(compiled=True)` and `compute_logits(compiled=True)`. With
        `dynamic_batch` the batch and context sizes stay symbolic (one graph for all of
        them); without, each padded shape gets its own graph."""
        self.compiled_layer = compile_fn(run_layer)  # type: ignore[assignment]
        self.compiled_logits = compile_fn(self.compute_logits)  # type: ignore[assignment]
        self.dynamic_batch = dynamic_batch

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
        on_layer_done: Callable[[int], None] | None = None,
        compiled: bool = False,
    ) -> torch.Tensor:
        """`compiled` runs the layers through `compile_decode`'s graph (decode batches)."""
        end = self.cfg.num_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end <= self.cfg.num_layers:
            raise ValueError(
                f"layer range [{start_layer}, {end}) is not inside [0, {self.cfg.num_layers})"
            )
        if start_layer == 0:
            if input_ids is None:
                raise ValueError("input_ids are required when starting at layer 0")
            h = self.embed_tokens(input_ids)
        else:
            if hidden_states is None:
                raise ValueError(f"hidden_states are required when starting at layer {start_layer}")
            h = hidden_states
        cs = self.cos_sin[positions].to(h.dtype)  # a gather; cast only if h is another dtype
        cos, sin_signed = cs[:, 0:1, :], cs[:, 1:2, :]
        step = self.compiled_layer if compiled and self.compiled_layer else run_layer
        if compiled and self.dynamic_batch:
            _mark_batch_dynamic(h, cos, sin_signed, meta.slot_mapping, meta.decode_slots)
            _mark_batch_dynamic(meta.decode_mask, context_dim=3)
        for i in range(start_layer, end):
            h = step(self.layers[i], h, cos, sin_signed, kv_caches[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return h

    def compute_logits(self, hidden_states: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """Final norm and LM head on the rows that sample; logits in the model's dtype (under
        tensor parallelism whole on rank 0 only): the sampler widens what it computes on."""
        if compiled and self.compiled_logits is not None:
            if self.dynamic_batch:
                _mark_batch_dynamic(hidden_states)
            return self.compiled_logits(hidden_states)
        return self.tp.gather_vocab(self.lm_head(self.norm(hidden_states)))


def run_layer(
    layer: nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    kv: KVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """One decoder layer: the unit `CausalLM.compile_decode` compiles."""
    out: torch.Tensor = layer(h, cos, sin_signed, kv, meta)
    return out


def _mark_batch_dynamic(*tensors: torch.Tensor | None, context_dim: int | None = None) -> None:
    """Tells the compiler that dim 0 (batch rows, or rows x context for the flat decode
    slots) and `context_dim` vary between steps; every other size is the model's own."""
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)
            if context_dim is not None:
                torch._dynamo.mark_dynamic(t, context_dim)
