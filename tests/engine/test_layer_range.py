"""Running layers [0, k) then [k, L) equals running [0, L), for a prefill and a decode step,
and the full stack's logits equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import get_backend
from hetero_pd.engine.kv_cache_manager import KVCacheManager
from hetero_pd.engine.model_runner import ModelRunner, StepInputs
from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import ScheduledChunk, SchedulerOutput
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM, KVCache
from hetero_pd.models.loader import load_model
from hetero_pd.sampling_params import SamplingParams

from .test_greedy_equivalence import TINY_MODELS

BLOCK_SIZE, NUM_BLOCKS = 4, 16
PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33]  # 11 tokens: three blocks
NEXT_TOKEN = 279
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> CausalLM:
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    return load_model(tiny_llama_dir, cfg, torch.float32, CPU, 64)


def new_runner(model: CausalLM) -> ModelRunner:
    return ModelRunner(model, model.cfg, NUM_BLOCKS, BLOCK_SIZE, CPU, torch.float32)


class Sequence:
    """One request's prefill step and then one decode step, as the scheduler lays them out."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
        self.req = Request("r", list(PROMPT), SamplingParams())
        assert self.kv.allocate_new(self.req, [], len(PROMPT))

    def prefill(self, runner: ModelRunner) -> StepInputs:
        return runner.prepare(SchedulerOutput([ScheduledChunk(self.req, len(PROMPT))]))

    def decode(self, runner: ModelRunner) -> StepInputs:
        self.req.num_computed_tokens = len(PROMPT)
        self.req.all_token_ids.append(NEXT_TOKEN)
        assert self.kv.allocate_slots(self.req, 1)
        return runner.prepare(SchedulerOutput([ScheduledChunk(self.req, 1)]))


def run_layers(
    model: CausalLM, inputs: StepInputs, caches: list[KVCache], split: int | None
) -> torch.Tensor:
    with torch.inference_mode():
        if split is None:
            return model(inputs.positions, inputs.meta, caches, input_ids=inputs.input_ids)
        h = model(
            inputs.positions, inputs.meta, caches, input_ids=inputs.input_ids, end_layer=split
        )
        return model(inputs.positions, inputs.meta, caches, hidden_states=h, start_layer=split)


def assert_same_kv(a: list[KVCache], b: list[KVCache]) -> None:
    for (ka, va), (kb, vb) in zip(a, b, strict=True):
        torch.testing.assert_close(ka, kb, rtol=0, atol=1e-6)
        torch.testing.assert_close(va, vb, rtol=0, atol=1e-6)


@pytest.mark.parametrize("split", [1, 2])
def test_split_equals_full_for_prefill_and_decode(model: CausalLM, split: int) -> None:
    assert model.cfg.num_layers == 3
    full, parts = new_runner(model), new_runner(model)
    seq_full, seq_parts = Sequence(), Sequence()

    h_full = run_layers(model, seq_full.prefill(full), full.kv_caches, None)
    h_parts = run_layers(model, seq_parts.prefill(parts), parts.kv_caches, split)
    assert h_full.shape == (len(PROMPT), model.cfg.hidden_size)
    torch.testing.assert_close(h_parts, h_full, rtol=0, atol=1e-6)
    assert_same_kv(parts.kv_caches, full.kv_caches)

    h_full = run_layers(model, seq_full.decode(full), full.kv_caches, None)
    h_parts = run_layers(model, seq_parts.decode(parts), parts.kv_caches, split)
    assert h_full.shape == (1, model.cfg.hidden_size)
    torch.testing.assert_close(h_parts, h_full, rtol=0, atol=1e-6)
    assert_same_kv(parts.kv_caches, full.kv_caches)


def test_one_layer_at_a_time_equals_full(model: CausalLM) -> None:
    full, parts = new_runner(model), new_runner(model)
    inputs = Sequence().prefill(full)
    h_full = run_layers(model, inputs, full.kv_caches, None)
    with torch.inference_mode():
        ids = inputs.input_ids
        h = model(inputs.positions, inputs.meta, parts.kv_caches, input_ids=ids, end_layer=1)
        for layer in range(1, model.cfg.num_layers):
            h = model(
                inputs.positions,
                inputs.meta,
                parts.kv_caches,
                hidden_states=h,
                start_layer=layer,
                end_layer=layer + 1,
            )
    torch.testing.assert_close(h, h_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_fixture", TINY_MODELS)
@pytest.mark.parametrize("kernels", [False, True])
def test_full_stack_logits_equal_transformers(
    model_fixture: str, kernels: bool, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(model_fixture)
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, CPU, 64)
    if kernels:  # as the engine runs it: the backend's linear kernels, dense weights freed
        model.use_linear_kernels(get_backend("cpu").linear_kernel)
        if torch.backends.mkldnn.is_available():
            assert model.layers[0].self_attn.o_proj.weight is None
            tied = model.cfg.tie_word_embeddings
            assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner, seq = new_runner(model), Sequence()
    with torch.inference_mode():
        ours = model.compute_logits(run_layers(model, seq.prefill(runner), runner.kv_caches, None))
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)

        ours = model.compute_logits(run_layers(model, seq.decode(runner), runner.kv_caches, None))
        ref = hf(torch.tensor([[*PROMPT, NEXT_TOKEN]])).logits[0, -1:].float()
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("start", "end"), [(-1, 2), (0, 0), (2, 2), (2, 1), (0, 4), (3, 3), (1, 5)]
)
def test_bad_layer_ranges_are_rejected(model: CausalLM, start: int, end: int) -> None:
    runner = new_runner(model)
    inputs = Sequence().prefill(runner)
    h = torch.zeros(len(PROMPT), model.cfg.hidden_size)
    with pytest.raises(ValueError, match=rf"layer range \[{start}, {end}\) is not inside \[0, 3\)"):
        model(
            inputs.positions,
            inputs.meta,
            runner.kv_caches,
            input_ids=inputs.input_ids,
            hidden_states=h,
            start_layer=start,
            end_layer=end,
        )


def test_missing_inputs_are_named(model: CausalLM) -> None:
    runner = new_runner(model)
    inputs = Sequence().prefill(runner)
    with pytest.raises(ValueError, match="input_ids are required when starting at layer 0"):
        model(inputs.positions, inputs.meta, runner.kv_caches)
    with pytest.raises(ValueError, match="hidden_states are required when starting at layer 2"):
        model(inputs.positions, inputs.meta, runner.kv_caches, start_layer=2)
