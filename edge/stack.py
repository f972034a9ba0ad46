"""The device's share of the model: embeddings and decoder layers [0, k) over a contiguous KV
cache passed in and returned explicitly, so the same module runs in torch and exports to ONNX.

KV layout on the device (one sequence, all edge layers stacked)::

    past_k, past_v:       [k, past_len, num_kv_heads, head_dim]
    present_k, present_v: [k, past_len + num_tokens, num_kv_heads, head_dim]

Position p of the sequence sits at row p of the cache, so the causal mask is
`key_position <= query_position`, the same for a prompt, a chunk or one decode token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import Attention, DecoderLayer
from hetero_pd.models.rotary import apply_rope, rope_table


class EdgeStack(nn.Module):
    """Layers [0, split_layer) of a Llama-family model with a functional KV cache.

    Parameter names match `CausalLM` (`embed_tokens.*`, `layers.{i}.*`), so the engine's
    checkpoint mapping applies unchanged; the final norm and LM head are not part of it.
    """

    cos_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, split_layer: int, max_positions: int) -> None:
        super().__init__()
        if cfg.mla is not None:
            raise ValueError(
                f"the edge stack runs K/V-head attention; {cfg.architecture} (MLA) has no "
                "edge split"
            )
        if not 1 <= split_layer < cfg.num_layers:
            raise ValueError(
                f"split layer {split_layer} must be in [1, {cfg.num_layers - 1}]: the edge runs "
                f"at least one layer and the cloud at least one of the {cfg.num_layers}"
            )
        self.cfg, self.split_layer, self.max_positions = cfg, split_layer, max_positions
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(split_layer))
        # cos and sin per position: [max_positions, 2, head_dim], the engine's own table.
        self.register_buffer("cos_sin", rope_table(cfg, max_positions), persistent=False)

    def empty_cache(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-length past for K or V: [k, 0, num_kv_heads, head_dim]."""
        cfg = self.cfg
        return torch.zeros(
            (self.split_layer, 0, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, positions: [n] long (positions continue the past: past_len, ...).

        Returns (hidden [n, hidden] after layer k-1, before any norm; present_k; present_v).
        """
        hidden, keys, values = self._run(self.embed_tokens(input_ids), positions, past_k, past_v)
        return hidden[-1], torch.stack(keys), torch.stack(values)

    def layer_outputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """A new sequence's hidden state before every edge layer and after the last
        ([split_layer + 1] tensors [n, hidden]: entry j is what a split at k = j sends; entry
        0 is the embeddings) and each layer's K and V ([n, kv_heads, head_dim]). The privacy
        bench inverts these."""
        past = self.empty_cache(self.embed_tokens.weight.dtype, input_ids.device)
        return self._run(self.embed_tokens(input_ids), positions, past, past)

    def _run(
        self, h: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        cs = self.cos_sin[positions].to(h.dtype)
        cos, sin = cs[:, 0:1, :], cs[:, 1:2, :]
        total = past_k.shape[1] + h.shape[0]
        key_pos = torch.arange(total, device=positions.device)
        # mask: [n, total] bool, True = attend
        mask = key_pos[None, :] <= positions[:, None]
        hidden, keys, values = [h], [], []
        for i, layer in enumerate(self.layers):
            h, k_all, v_all = self._layer(layer, h, cos, sin, past_k[i], past_v[i], mask)
            hidden.append(h)
            keys.append(k_all)
            values.append(v_all)
        return hidden, keys, values

    def _layer(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        assert isinstance(attn, Attention)
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(attn.split, dim=-1)
        q, k = attn.norm_heads(q.view(-1, heads, dim), k.view(-1, kv_heads, dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # k_all, v_all: [total, kv_heads, dim]
        k_all = torch.cat((past_k, k.reshape(-1, kv_heads, dim)), dim=0)
        v_all = torch.cat((past_v, v.reshape(-1, kv_heads, dim)), dim=0)
        # o: [1, heads, n, dim]; a batch of one keeps SDPA 4-D, which both ONNX exporters take.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            _expand_heads(k_all, heads)[None],
            _expand_heads(v_all, heads)[None],
            attn_mask=mask,
            scale=attn.scale,
        )
        x = x + attn.o_proj(o[0].transpose(0, 1).reshape(-1, heads * dim))
        return x + layer.mlp(layer.post_attention_layernorm(x)), k_all, v_all


def _expand_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[total, kv_heads, dim] -> [heads, total, dim]; query head h reads KV head h // group
    (what `enable_gqa` does), written with expand/reshape so it exports to plain ONNX."""
    total, kv_heads, dim = kv.shape
    group = heads // kv_heads
    t = kv.transpose(0, 1)[:, None]
    return t.expand(kv_heads, group, total, dim).reshape(heads, total, dim)
