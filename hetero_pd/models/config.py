"""Model configuration parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import json
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
}
#: Families whose attention normalises each q and k head (RMSNorm over head_dim) before rope.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A model directory or its config.json cannot be used."""


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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token takes across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

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
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
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
            **(_moe_fields(raw, family, source) if family in MOE_FAMILIES else {}),
        )


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
