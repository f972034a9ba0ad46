"""DeepSeek-V3 (DeepseekV3ForCausalLM): the Llama family's decoder with multi-head latent
attention (mla.py) and, from layer first_k_dense_replace on, a mixture of experts with
DeepSeek's routing and shared experts (moe.py). Layers [0, first_k_dense_replace) keep a
dense MLP. Checkpoint names are transformers' (loader.py maps them)."""

from __future__ import annotations

from torch import nn

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import MLP, CausalLM, DecoderLayer
from hetero_pd.models.mla import MLAttention
from hetero_pd.models.moe import SparseMoE
from hetero_pd.models.parallel import Parallel


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama family's decoder layer with MLA, and DeepSeek's MoE with shared experts."""

    def attention(self, cfg: ModelConfig, tp: Parallel) -> nn.Module:
        return MLAttention(cfg, tp)

    def feed_forward(self, cfg: ModelConfig, index: int, tp: Parallel) -> nn.Module:
        if index not in cfg.moe_layers:
            return MLP(cfg, tp)
        moe = SparseMoE(cfg, tp)
        if cfg.n_shared_experts:
            # Each rank's columns of them (parallel.take), summed in the routed experts'
            # all-reduce: one collective for the block.
            inter = cfg.moe_intermediate_size * cfg.n_shared_experts // tp.size
            moe.shared_experts = MLP(cfg, tp, inter, reduce=False)
        return moe


class DeepseekV3(CausalLM):
    """CausalLM with DeepSeek-V3's decoder layers; everything else is the Llama family's."""

    def make_layer(self, cfg: ModelConfig, index: int, tp: Parallel) -> nn.Module:
        return DeepseekDecoderLayer(cfg, index, tp)
