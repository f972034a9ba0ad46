"""A split (edge) engine runs layers [k, L) on hidden states received from a device and
gives the same greedy tokens as the whole model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class DeviceLayers:
    """Stands in for the edge runtime: layers [0, k) of the same weights, recomputed over
    the whole sequence each time (causal, so the last row is exact)."""

    def __init__(self, path: Path, k: int) -> None:
        cfg = ModelConfig.from_dir(path)
        self.model = load_model(path, cfg, torch.float32, torch.device("cpu"), 512)
        shape = (64, 16, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        self.k = k

    @torch.inference_mode()
    def hidden(self, token_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n)])
        ids = torch.tensor(token_ids)
        return self.model(torch.arange(n), meta, self.kv, input_ids=ids, end_layer=self.k)


@pytest.mark.parametrize("k", [1, 2])
def test_split_engine_equals_whole_model(tiny_llama_dir: Path, k: int) -> None:
    rng = random.Random(k)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (7, 30)]
    expected = LLM(str(tiny_llama_dir), dtype="float32").generate(prompts, GREEDY)
    device = DeviceLayers(tiny_llama_dir, k)
    cloud = LLM(
        str(tiny_llama_dir), dtype="float32", start_layer=k, max_num_batched_tokens=16
    ).engine
    seqs = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    for rid, p in seqs.items():
        cloud.add_split_request(device.hidden(p), GREEDY, rid)
    done: dict[str, list[int]] = {}
    while cloud.has_unfinished_requests():
        for out in cloud.step():
            token = out.outputs[0].delta_token_ids[0]
            seqs[out.request_id].append(token)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
            else:  # the device runs its layers on the new token and sends the result back
                cloud.supply_hidden(out.request_id, device.hidden(seqs[out.request_id])[-1:])
    for i, exp in enumerate(expected):
        assert done[f"r{i}"] == exp.outputs[0].token_ids
    cloud.check_integrity()


def test_split_engine_rejects_token_prompts_and_bad_shapes(tiny_llama_dir: Path) -> None:
    cloud = LLM(str(tiny_llama_dir), start_layer=1).engine
    with pytest.raises(ValueError, match="add_split_request"):
        cloud.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match=r"\[num_tokens, 64\]"):
        cloud.add_split_request(torch.zeros(3, 5), GREEDY, "x")
    cloud.add_split_request(torch.zeros(3, 64), GREEDY, "y")
    with pytest.raises(ValueError, match="not sampled yet"):
        cloud.supply_hidden("y", torch.zeros(1, 64))
    with pytest.raises(ValueError, match="outside the model"):
        LLM(str(tiny_llama_dir), start_layer=3)
