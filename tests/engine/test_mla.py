"""DeepSeek-V3 (MLA + DeepSeek's MoE) against transformers in float32: logits of prefill
(latents expanded per head) and of decode (weight absorption over the paged latent cache),
the latent KV layout's size, sharded checkpoints, and the config values it refuses."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.model_runner import allocate_kv_tensors, layer_caches
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig, ModelConfigError
from hetero_pd.models.loader import load_model

#: Our logits against transformers', float32. Decode's absorption multiplies in another
#: order than transformers' expanded K/V: measured 2e-7 apart (1.6e-3 without yarn's mscale).
LOGITS_TOL = 1e-4
PROMPT = [(37 * i + 5) % 500 + 1 for i in range(29)]


def our_logits(path: Path, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits of every position: tokens [0, prefill) as one prefill (expanded K/V), each
    later token as one decode step over the cache (absorption), block size 4."""
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), len(tokens))
    bs, blocks = 4, len(tokens) // 4 + 2
    kv = allocate_kv_tensors(
        cfg.num_layers, blocks, cfg.kv_block_shape(bs), torch.float32, torch.device("cpu"), 1
    )
    caches = layer_caches(cfg, kv)
    rows = []
    with torch.inference_mode():
        pos = torch.arange(prefill)
        meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, prefill)])
        hidden = model(pos, meta, caches, input_ids=torch.tensor(tokens[:prefill]))
        rows.append(model.compute_logits(hidden))
        for p in range(prefill, len(tokens)):
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([p]),
                num_decode_tokens=1,
                decode_slots=torch.arange(p + 1),
                decode_mask=torch.ones(1, 1, 1, p + 1, dtype=torch.bool),
            )
            hidden = model(torch.tensor([p]), meta, caches, input_ids=torch.tensor([tokens[p]]))
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def assert_logits_match(path: Path, hf_model: Callable[[Path, torch.dtype], Any]) -> None:
    with torch.inference_mode():
        ref = hf_model(path, torch.float32)(torch.tensor([PROMPT])).logits[0]
    ours = our_logits(path, PROMPT, prefill=17)
    assert ours.shape == ref.shape
    diff = float((ours - ref).abs().max())
    assert diff <= LOGITS_TOL, f"logits {diff} apart"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_prefill_and_absorbed_decode_logits_match_transformers(
    tiny_deepseek_v3_dir: Path, hf_model: Callable[[Path, torch.dtype], Any]
) -> None:
    assert_logits_match(tiny_deepseek_v3_dir, hf_model)


def test_full_rank_q_and_plain_rope_match_transformers(
    tmp_path: Path,
    tiny_deepseek_v3_dir: Path,
    hf_model: Callable[[Path, torch.dtype], Any],
    hf_greedy: Callable[..., list[int]],
) -> None:
    """q_lora_rank None (one q_proj), rope not interleaved and not scaled, one group; and at
    tensor-parallel size 2, where q_proj is split by heads (not q_b_proj)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads((tiny_deepseek_v3_dir / "config.json").read_text())
    raw.update(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(8)
    model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(raw)).eval()
    model.save_pretrained(tmp_path)
    assert ModelConfig.from_dir(tmp_path).mla.q_lora_rank is None  # type: ignore[union-attr]
    assert_logits_match(tmp_path, hf_model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_deepseek_v3_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        got = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        assert list(got) == hf_greedy(tmp_path, PROMPT, 8)
    finally:
        llm.engine.close()


def test_latent_kv_layout_and_bytes_per_token(tiny_deepseek_v3_dir: Path) -> None:
    """One tensor per layer, per token kv_lora_rank + qk_rope_head_dim values, no heads."""
    cfg = ModelConfig.from_dir(tiny_deepseek_v3_dir)
    assert cfg.mla is not None
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert width == 32 + 16
    assert cfg.kv_bytes_per_token == cfg.num_layers * width
    llm = LLM(str(tiny_deepseek_v3_dir), dtype="float32", block_size=8, num_kv_blocks=16)
    tensors = llm.engine.runner.kv_tensors
    assert len(tensors) == cfg.num_layers
    assert {tuple(t.shape[1:]) for t in tensors} == {(8, 1, width)}
    per_token = sum(t[0].numel() * t.element_size() for t in tensors) // 8
    assert per_token == cfg.kv_bytes_per_token * 4  # float32
    assert not llm.engine.runner.native_decode


def test_sharded_checkpoint_is_read_through_its_index(tiny_deepseek_v3_dir: Path) -> None:
    """The fixture is saved in shards; a shard gone is an error naming its tensors."""
    index = json.loads((tiny_deepseek_v3_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    LLM(str(tiny_deepseek_v3_dir), dtype="float32", num_kv_blocks=8)  # loads from shards
    broken = tiny_deepseek_v3_dir.parent / "broken-deepseek"
    shutil.copytree(tiny_deepseek_v3_dir, broken)
    (broken / shards[-1]).unlink()
    lost = [n for n, f in index["weight_map"].items() if f == shards[-1]]
    with pytest.raises(ValueError, match=f"weights missing for {len(lost)} tensor") as err:
        LLM(str(broken), dtype="float32", num_kv_blocks=8)
    named = re.findall(r"'([^']+)'", str(err.value).split("e.g.")[1])
    assert named and set(named) <= set(lost)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"attention_bias": True}, "attention_bias"),
        ({"n_group": 3}, "n_group"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_unsupported_deepseek_values_are_named(
    tiny_deepseek_v3_dir: Path, edit: dict[str, Any], named: str
) -> None:
    raw = json.loads((tiny_deepseek_v3_dir / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.from_dict({**raw, **edit})
