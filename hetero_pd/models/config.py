"""Model configuration parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture name in config.json -> our model family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
#: Families whose attention normalises each q and k head (RMSNorm over head_dim) before rope.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
#: Families with multi-head latent attention (mla.py) and DeepSeek's MoE (`_deepseek_fields`).
MLA_FAMILIES = ("deepseek_v3",)
SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A model directory or its config.json cannot be used."""


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3; mla.py)."""

    kv_lora_rank: int
    #: None: q comes from one projection (q_proj); else through a low-rank q_a/q_b pair.
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: The rope part's weights lay its dimensions out in pairs (x0, x1), (x2, x3), ...
    rope_interleave: bool
    #: Softmax scale: qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2.
    softmax_scale: float


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    #: RMSNorm on each q and k head before rope (Qwen3's `q_norm`, `k_norm`).
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    #: The dtype the checkpoint was saved in ("bfloat16", "float32", ...), if it says.
    checkpoint_dtype: str | None = None
    # Mixture of experts (moe.py); num_experts 0 = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    #: Top-k router weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE if it says).
    norm_topk_prob: bool = False
    #: The layers whose MLP is the MoE block (Qwen3-MoE may keep some dense).
    moe_layers: tuple[int, ...] = ()
    #: How the router scores experts: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" with the
    #: score-correction bias and group-limited top-k (DeepSeek-V3; moe.grouped_topk).
    moe_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    #: Experts every token goes through beside the routed ones (DeepSeek-V3), 0 = none.
    n_shared_experts: int = 0
    #: Multi-head latent attention (DeepSeek-V3, mla.py); kv_lora_rank 0 = ordinary heads.
    mla: MLAConfig | None = None

    @property
    def kv_tensors_per_layer(self) -> int:
        """KV tensors one layer caches: K and V, or MLA's one latent tensor."""
        return 1 if self.mla else 2

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """The shape of one block of one layer's KV tensor (every tensor has it)::

            heads: K, V     each [block_size, num_kv_heads, head_dim]
            MLA:   latent   [block_size, 1, kv_lora_rank + qk_rope_head_dim]

        MLA caches per token the normalised latent c_kv and the roped shared key k_pe,
        side by side in one single-"head" row (see mla.py for why one tensor).
        """
        if self.mla:
            return (block_size, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return (block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers, per byte of dtype."""
        per_layer = self.kv_tensors_per_layer * math.prod(self.kv_block_shape(1))
        return self.num_layers * per_layer

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{path}: no config.json (expected a Hugging Face model folder)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(raw.get("model_type", ""))
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelConfigError(f"{source}: missing required key {key!r}")
            return raw[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"{source}: unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if rope_type == "yarn" and "original_max_position_embeddings" not in rope:
            raise ModelConfigError(
                f"{source}: rope type 'yarn' needs original_max_position_embeddings"
            )
        rope_params = tuple(
            sorted(
                (k, float(v))
                for k, v in rope.items()
                if isinstance(v, (int, float)) and k not in ("rope_theta",)
            )
        )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        family = SUPPORTED_ARCHITECTURES[arch]
        _reject_unsupported(raw, source)
        extra = _moe_fields(raw, family, source) if family in MOE_FAMILIES else {}
        if family in MLA_FAMILIES:
            extra = _deepseek_fields(raw, source)
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        fields: dict[str, Any] = dict(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=family in QK_NORM_FAMILIES,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_checkpoint_dtype(raw),
        )
        return cls(**{**fields, **extra})


def _reject_unsupported(raw: dict[str, Any], source: str) -> None:
    """Config fields whose other values this model code would silently get wrong."""
    act = raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(
            f"{source}: unsupported hidden_act {act!r}; supported: {SUPPORTED_ACTIVATIONS}"
        )
    if raw.get("mlp_bias"):
        raise ModelConfigError(f"{source}: unsupported mlp_bias true (MLP layers with biases)")


def _moe_fields(raw: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The MoE fields of a Mixtral or Qwen3-MoE config.json."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ModelConfigError(
            f"{source}: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]"
        )
    layers = int(raw["num_hidden_layers"])
    size_key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    if not raw.get(size_key):
        raise ModelConfigError(f"{source}: missing required key {size_key!r}")
    if family == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(raw[size_key]),
            norm_topk_prob=True,
            moe_layers=tuple(range(layers)),
        )
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw[size_key]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def _checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    """ "bfloat16", "float16" or "float32" from config.json ("dtype", older "torch_dtype")."""
    name = raw.get("dtype") or raw.get("torch_dtype")
    return name if name in ("bfloat16", "float16", "float32") else None


#: DeepSeek config.json keys and the only values this code computes correctly.
_DEEPSEEK_FIXED = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "attention_bias": False,
}


def _deepseek_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """MLA and MoE fields of a DeepSeek-V3 config.json (what transformers' DeepseekV3 reads)."""
    for key, want in _DEEPSEEK_FIXED.items():
        if key in raw and raw[key] != want:
            raise ModelConfigError(
                f"{source}: unsupported {key} {raw[key]!r} for DeepseekV3ForCausalLM "
                f"(supported: {want!r})"
            )
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ModelConfigError(
                f"{source}: {key} must be a positive integer, not {raw.get(key)!r}"
            )
    experts, top_k = int(raw.get("n_routed_experts") or 0), int(raw.get("num_experts_per_tok") or 0)
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if not 0 < top_k <= experts:
        raise ModelConfigError(
            f"{source}: num_experts_per_tok {top_k} must be in [1, n_routed_experts {experts}]"
        )
    if experts % n_group or not 0 < topk_group <= n_group or experts // n_group < 2:
        raise ModelConfigError(
            f"{source}: n_group {n_group} must divide n_routed_experts {experts} into groups "
            f"of 2 or more, and topk_group {topk_group} must be in [1, n_group]"
        )
    if top_k > topk_group * (experts // n_group):
        raise ModelConfigError(
            f"{source}: num_experts_per_tok {top_k} exceeds the experts of topk_group "
            f"{topk_group} groups ({topk_group * (experts // n_group)})"
        )
    if top_k and not raw.get("moe_intermediate_size"):
        raise ModelConfigError(f"{source}: missing required key 'moe_intermediate_size'")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    qk_head_dim = int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get(
        "mscale_all_dim"
    ):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1 if factor > 1 else 1
        scale *= mscale * mscale
    q_lora = raw.get("q_lora_rank")
    layers = int(raw["num_hidden_layers"])
    return dict(
        # The rope table's width; the one latent "head" is the cache's (kv_block_shape).
        head_dim=int(raw["qk_rope_head_dim"]),
        num_kv_heads=1,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_layers=tuple(range(int(raw.get("first_k_dense_replace") or 0), layers)),
        moe_scoring="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        mla=MLAConfig(
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            softmax_scale=scale,
        ),
    )
