"""Builds a CausalLM from a Hugging Face folder of safetensors weights."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.deepseek import DeepseekV3
from hetero_pd.models.llama import CausalLM
from hetero_pd.models.moe import (
    expert_slice,
    expert_target,
    missing_expert_tensors,
    router_checkpoint_name,
    router_target,
)
from hetero_pd.models.parallel import SINGLE, Parallel, local_experts, shard_config, take


class ModelLoadError(ValueError):
    """Weights are missing, corrupt or do not match the config (a ValueError, like
    ModelConfigError, so callers such as the CLI report it as a bad model argument)."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint sub-name -> (our parameter, index of the shard inside a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """Maps a checkpoint tensor name to (our parameter name, shard index or None)."""
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name[len("model.") :], None
    m = _LAYER.match(name)
    if m is None:
        return name, None
    layer, rest = m.groups()
    expert = expert_target(rest)
    if expert is not None:
        return f"layers.{layer}.{expert[0]}", expert[1]
    rest = router_target(rest) or rest
    module, _, kind = rest.rpartition(".")
    # MLA's q_proj (no low-rank q) is a projection of its own, not a third of a qkv_proj.
    if module in _FUSED and not (cfg.mla and module.startswith("self_attn.")):
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{rest}", None


def missing_tensors(cfg: ModelConfig, param: str, filled: set[int | None]) -> list[str]:
    """Checkpoint names of the tensors that `param` still lacks."""
    name = param if param.startswith("lm_head.") else f"model.{param}"
    m = _LAYER.match(name)
    if m is not None and ".experts_" in param:
        return missing_expert_tensors(cfg, m.group(1), param, filled)
    module, _, kind = m.group(2).rpartition(".") if m else ("", "", "")
    shards = [(ckpt, i) for ckpt, (fused, i) in _FUSED.items() if fused == module]
    if m is None or not shards:
        return [] if filled else [router_checkpoint_name(cfg, name)]
    return [f"model.layers.{m.group(1)}.{ckpt}.{kind}" for ckpt, i in shards if i not in filled]


def _shard_sizes(cfg: ModelConfig, param: str, rows: int) -> list[int]:
    """The rows of each part of fused parameter `param` (`rows` in all)."""
    if "qkv_proj" in param:
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [rows // 2, rows // 2]  # gate_up_proj: gate rows, then up rows


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    return files


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The model class of `cfg`'s architecture."""
    return DeepseekV3 if cfg.mla else CausalLM


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: Parallel = SINGLE,
) -> CausalLM:
    """Loads weights into a new model on `device` in `dtype`, checking every shape. Under
    tensor parallelism (`tp`), the rank's slices only: each read from its file alone."""
    path = Path(path)
    whole, cfg = cfg, shard_config(cfg, tp)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions, tp)
    materialize(model, device)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight")
    filled: dict[str, set[int | None]] = {}
    first = local_experts(whole, tp).start if cfg.num_experts else 0
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    target = _target(name, whole)
                    part = take(whole, tp, *target)
                    if part.skip:  # another rank's expert
                        filled.setdefault(target[0], set()).add(target[1])
                        continue
                    copy_tensor(cfg, params, filled, name, part.read(f, name), file, first)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file ({e})") from e
    missing = [name for p in params for name in missing_tensors(cfg, p, filled.get(p, set()))]
    if missing:
        raise ModelLoadError(
            f"{path}: weights missing for {len(missing)} tensor(s), e.g. {missing[:3]}"
        )
    model.tie_weights()
    model.to(dtype)
    model.init_rope(device, dtype)
    return model.eval()


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Gives every meta parameter and buffer uninitialised storage on `device` (what
    `Module.to_empty` does, without its detour through torch's symbolic shapes, whose sympy
    import costs a worker 0.3-0.7 s of start-up)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            module.register_parameter(name, torch.nn.Parameter(empty, p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            persistent = name not in module._non_persistent_buffers_set
            empty = torch.empty(b.shape, dtype=b.dtype, device=device)
            module.register_buffer(name, empty, persistent=persistent)


def _mtp_layer(cfg: ModelConfig, name: str) -> bool:
    """DeepSeek-V3 checkpoints append multi-token-prediction layers after the last decoder
    layer (`model.layers.61.*`); greedy decoding does not use them (as transformers)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def copy_tensor(
    cfg: ModelConfig,
    params: dict[str, torch.nn.Parameter],
    filled: dict[str, set[int | None]],
    name: str,
    tensor: torch.Tensor,
    file: Path,
    first_expert: int = 0,
) -> None:
    """Copies checkpoint tensor `name` into its place in `params`; stacked experts' rows
    are numbered from `first_expert` (a tensor-parallel rank's first)."""
    target, shard = _target(name, cfg)
    if target.endswith("rotary_emb.inv_freq"):
        return
    if target == "lm_head.weight" and cfg.tie_word_embeddings:
        return
    if cfg.mla and _mtp_layer(cfg, name):
        return
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"{file}: unexpected tensor {name!r} for a {cfg.architecture}")
    dest = param.data
    if ".experts_" in target and shard is not None:
        dest = expert_slice(cfg, dest, target, shard - 2 * first_expert)
    elif shard is not None:
        sizes = _shard_sizes(cfg, target, dest.shape[0])
        offset = sum(sizes[:shard])
        dest = dest.narrow(0, offset, sizes[shard])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(dest.shape)}"
        )
    with torch.no_grad():
        dest.copy_(tensor)
    filled.setdefault(target, set()).add(shard)
