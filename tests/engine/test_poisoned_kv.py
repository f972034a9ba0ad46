"""One request's values never reach another's outputs. An edge prompt's hidden states and
early-layer KV are refused unless every value is finite in the cache's dtype; and whatever a
KV slot holds (a freed block's stale KV, a poisoned request's own), a decode row never reads a
slot it does not own: masked positions read a zeroed null slot, since attention weighs masked
values by 0 and 0 x inf is NaN, in SDPA and in the compiled loops alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_pd import SamplingParams
from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine

from .test_edge_prompt import device_side, run

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
K = 1  # the device's layers
ATTACKER = [(7 * j) % 500 + 1 for j in range(40)]  # longest: the batch's context length
VICTIMS = [[(3 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 9, 21))]


def victims_beside(model_dir: Path, engine: LLMEngine, poison: bool) -> dict[str, list[int]]:
    """Victims of mixed lengths (edge and plain prompts) decoding in one batch with an edge
    prompt; with `poison`, fault injection puts inf where the victims must never look."""
    if poison:
        # Stale KV a freed block may hold: every block the pool hands out starts as inf.
        for t in engine.runner.kv_tensors:
            t[: engine.kv.pool.num_blocks] = float("inf")
    hidden, early = device_side(model_dir, K, ATTACKER)
    engine.add_edge_prompt_request(hidden, early, GREEDY, "attacker")  # gets block 0 first
    if poison:
        # Early KV that got past the entry check: written into the attacker's own blocks,
        # block 0 among them (where a shorter row's padded block-table entries point).
        early.fill_(float("inf"))
    for i, ids in enumerate(VICTIMS):
        engine.add_request(ids, GREEDY, f"plain-{i}")
        engine.add_edge_prompt_request(*device_side(model_dir, K, ids), GREEDY, f"edge-{i}")
    done = run(engine)
    engine.check_integrity()
    victims = {f"{kind}-{i}" for kind in ("plain", "edge") for i in range(len(VICTIMS))}
    assert set(done) == victims | {"attacker"}
    return {rid: done[rid] for rid in victims}


def engine_for(model_dir: Path, dtype: str, **kw: object) -> LLMEngine:
    # No prefix cache: the poison would overwrite the clean run's cached blocks too.
    cfg = EngineConfig.from_kwargs(
        model=str(model_dir),
        num_kv_blocks=64,
        dtype=dtype,
        num_threads=1,
        enable_prefix_caching=False,
        **kw,
    )
    return LLMEngine(cfg)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_victim_keeps_its_tokens_beside_poisoned_kv_eager(
    tiny_llama_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager decode attention by SDPA (the CPU kernel, off here, reads float32 only)."""
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", "0")
    clean = victims_beside(tiny_llama_dir, engine_for(tiny_llama_dir, dtype), poison=False)
    engine = engine_for(tiny_llama_dir, dtype, compile="off")
    assert not engine.runner.native_decode
    assert victims_beside(tiny_llama_dir, engine, poison=True) == clean


def test_a_victim_keeps_its_tokens_beside_poisoned_kv_compiled(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled decode attention by inductor's loops (`_decode_fused`). Compiles once."""
    monkeypatch.setenv("HETERO_PD_NATIVE_ATTENTION", "0")
    engine = engine_for(tiny_llama_dir, "float32", compile="on")
    assert engine.runner.compiled and not engine.runner.native_decode
    clean = victims_beside(tiny_llama_dir, engine, poison=False)
    steps = engine.runner.compiled_steps
    assert steps > 0
    assert victims_beside(tiny_llama_dir, engine, poison=True) == clean
    assert engine.runner.compiled_steps > steps


@pytest.mark.parametrize(
    ("dtype", "too_big"), [("float32", float("inf")), ("bfloat16", 3.4e38), ("float16", 7e4)]
)
def test_edge_values_outside_the_cache_dtype_are_refused(
    tiny_llama_dir: Path, dtype: str, too_big: float
) -> None:
    engine = engine_for(tiny_llama_dir, dtype)
    hidden, early = device_side(tiny_llama_dir, K, [1, 2, 3])
    bad_early = early.clone()
    bad_early[0, 1, 2, 0, 5] = -too_big
    with pytest.raises(ValueError, match=rf"early_kv .*outside {dtype}'s finite range"):
        engine.add_edge_prompt_request(hidden, bad_early, GREEDY, "bad-kv")
    bad_hidden = hidden.clone()
    bad_hidden[1, 7] = too_big
    with pytest.raises(ValueError, match=rf"hidden .*outside {dtype}'s finite range"):
        engine.add_edge_prompt_request(bad_hidden, early, GREEDY, "bad-hidden")
    bad_hidden[1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"hidden .*NaN"):
        engine.add_edge_prompt_request(bad_hidden, early, GREEDY, "nan-hidden")
    assert not engine.has_unfinished_requests()


def test_a_split_engine_refuses_hidden_states_outside_its_dtype(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir, "bfloat16", start_layer=K)
    hidden, _ = device_side(tiny_llama_dir, K, [1, 2, 3])
    huge = hidden.clone()
    huge[2, 0] = 3.4e38  # finite in float32, past bfloat16's largest (~3.39e38)
    with pytest.raises(ValueError, match=r"hidden .*outside bfloat16's finite range"):
        engine.add_split_request(huge, GREEDY, "huge")
    engine.add_split_request(hidden, GREEDY, "split")
    with pytest.raises(ValueError, match=r"hidden .*outside bfloat16's finite range"):
        engine.supply_hidden("split", torch.full((1, hidden.shape[1]), -float("inf")))
