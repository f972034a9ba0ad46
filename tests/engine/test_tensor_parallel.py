"""Tensor parallelism inside one engine (gloo, 2 ranks on the CPU): the same greedy tokens
as one process and as transformers, each rank holding only its shard; a rank that dies
stops the engine with an error naming it."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.tp.group import TPRankError
from hetero_pd.models.config import ModelConfig, ModelConfigError
from hetero_pd.models.parallel import check_split, kv_head_range
from tests.conftest import TINY, _save_tiny
from tests.engine.test_greedy_equivalence import random_prompts

Ref = Callable[[Path, list[int], int], list[int]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
Make = Callable[..., LLM]


@pytest.fixture
def make_llm() -> Iterator[Make]:
    made: list[LLM] = []

    def make(path: Path, **kwargs: object) -> LLM:
        llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()


@pytest.fixture(scope="module")
def tiny_mqa_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """One KV head for four query heads: at TP 2 each rank holds a replica of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY, "num_key_value_heads": 1}, attention_bias=True)
    dest = tmp_path_factory.mktemp("tiny-mqa")
    return _save_tiny(config, LlamaForCausalLM, dest, tokenizer_dir, seed=8, random_norms=True)


@pytest.mark.parametrize(
    "model_fixture",
    ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_deepseek_v3_dir"],
)
def test_tp2_matches_tp1_and_transformers(
    model_fixture: str, request: pytest.FixtureRequest, hf_greedy: Ref, make_llm: Make
) -> None:
    path = request.getfixturevalue(model_fixture)
    # A 24-token budget splits the 30-token prompt: chunks attend to cached context.
    tp2 = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=24)
    tp1 = make_llm(path, max_num_batched_tokens=24)
    prompts = random_prompts([3, 30, 9], 512, seed=7)
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    outs2, outs1 = tp2.generate(prompts, params), tp1.generate(prompts, params)
    for prompt, o2, o1 in zip(prompts, outs2, outs1, strict=True):
        assert o2.outputs[0].token_ids == hf_greedy(path, prompt, params.max_tokens)
        assert o2.outputs[0].token_ids == o1.outputs[0].token_ids
        got_lps, want_lps = o2.outputs[0].logprobs or [], o1.outputs[0].logprobs or []
        assert len(got_lps) == params.max_tokens
        for got, want in zip(got_lps, want_lps, strict=True):
            assert got.keys() == want.keys()
            for token, lp in want.items():
                assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert len(o2.prompt_logprobs or []) == len(prompt)
    tp2.engine.check_integrity()
    # Rank 0 holds half the heads, KV heads, MLP columns and vocabulary (the CPU's linear
    # kernels may hold the matrices outside the parameters: shapes, not bytes, tell).
    cfg, model = tp1.engine.model_config, tp2.engine.runner.model
    assert model.embed_tokens.num_embeddings == cfg.vocab_size // 2
    attn, kv = model.layers[0].self_attn, tp2.engine.runner.kv_caches[0]
    if cfg.mla is None:
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        assert attn.qkv_proj.out_features == heads // 2 * cfg.head_dim
        assert kv[0].shape[2] == cfg.num_kv_heads // 2
    else:  # half the heads; the latent, which has none, whole on each rank
        qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
        assert attn.q_b_proj.out_features == cfg.num_heads // 2 * qk
        assert attn.o_proj.in_features == cfg.num_heads // 2 * cfg.mla.v_head_dim
        assert kv[0].shape[1:] == cfg.kv_block_shape(8)
        moe = model.layers[1].mlp
        assert moe.experts_down.shape[0] == cfg.num_experts // 2
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        assert moe.shared_experts.down_proj.in_features == shared // 2


def test_kv_head_replicated_when_tp_exceeds_kv_heads(tiny_mqa_dir: Path, hf_greedy: Ref) -> None:
    llm = LLM(str(tiny_mqa_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    k_cache = llm.engine.runner.kv_caches[0][0]
    assert k_cache.shape[2] == 1  # [blocks, block_size, kv_heads, head_dim]
    prompts = random_prompts([5, 21], 512, seed=9)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_mqa_dir, prompt, GREEDY.max_tokens)
    # Dropped without close(): its rank is killed and the process may start another group.
    assert llm.engine.ranks is not None
    child = llm.engine.ranks.procs[0]
    del llm
    gc.collect()
    assert child.returncode is not None
    assert not torch.distributed.is_initialized()


def test_a_killed_rank_stops_the_engine_with_its_name(tiny_qwen3_dir: Path, make_llm: Make) -> None:
    llm = make_llm(tiny_qwen3_dir, tensor_parallel_size=2)
    ranks = llm.engine.ranks
    assert ranks is not None and len(ranks.procs) == 1
    child = ranks.procs[0]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    with pytest.raises(TPRankError, match=r"rank 1 \(pid \d+\) exited with signal SIGKILL"):
        llm.generate([[1, 2, 3]], GREEDY)
    # Broken for good: the next step says so at once, nothing waits on the dead rank.
    with pytest.raises(TPRankError, match="SIGKILL"):
        llm.generate([[4, 5]], GREEDY)


# The ranks' interpreter, finalizing forever on its way out (as torch's teardown takes
# seconds on a busy machine); the variable keeps it to the ranks this test starts.
SLOW_EXIT = """
import atexit, os, threading
if os.environ.get("HPD_TEST_RANK_HANGS_AT_EXIT"):
    atexit.register(threading.Event().wait)
"""


def test_a_stopped_rank_exits_at_once(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank told to STOP leaves the group and exits by itself (code 0), without waiting
    for its interpreter's finalization: an engine's close, a TP worker's stop or restart,
    does not pay it (else rank 0 waits up to 10 s, then kills it: -9)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_EXIT)
    monkeypatch.syspath_prepend(str(tmp_path))  # rank 0's sys.path is the rank's PYTHONPATH
    monkeypatch.setenv("HPD_TEST_RANK_HANGS_AT_EXIT", "1")
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    assert llm.engine.ranks is not None
    (child,) = llm.engine.ranks.procs
    llm.engine.close()
    assert child.returncode == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=3), "does not divide the model's num_attention_heads"),
        (dict(tensor_parallel_size=64), "does not divide the model's num_attention_heads"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (dict(tensor_parallel_size=2, start_layer=1), "start_layer > 0"),
        (dict(tensor_parallel_size=2, compile="on"), "compile 'on'"),
        (dict(tensor_parallel_size=2, kv_cache_host_gb=0.1), "KV cache tiers"),
        (dict(tensor_parallel_size=2, role="prefill", device="cuda"), "'prefill' off the CPU"),
    ],
)
def test_unsupported_combinations_are_named(
    tiny_llama_dir: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", **kwargs)
    assert not torch.distributed.is_initialized()


def test_bench_tp_reports_weight_bytes_per_rank(
    tiny_mixtral_dir: Path,
    tiny_deepseek_v3_dir: Path,
    hf_model: Callable[[Path, torch.dtype], Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hetero_pd.bench.tp import main

    assert main([str(tiny_mixtral_dir), str(tiny_deepseek_v3_dir), "--no-timing"]) == 0
    mixtral, deepseek = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    ranks = mixtral["weight_bytes_tp2_per_rank"]
    # 4 of 8 experts, half the heads, MLP columns and vocabulary each; norms and router whole
    assert ranks[0] == ranks[1] and 0.5 < ranks[0] / mixtral["weight_bytes_tp1"] < 0.51
    assert "features" in mixtral["cpu"]
    # MLA counted as DeepSeek's layers: at TP 1 every transformers weight (and router bias);
    # at TP 2 more than half, the latent's projections and norms being on each rank whole.
    hf = hf_model(tiny_deepseek_v3_dir, torch.float32)
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    hf_bytes = 4 * sum(t.numel() for t in (*hf.parameters(), *biases))
    assert deepseek["weight_bytes_tp1"] == hf_bytes
    ranks = deepseek["weight_bytes_tp2_per_rank"]
    assert ranks[0] == ranks[1] and 0.5 < ranks[0] / deepseek["weight_bytes_tp1"] < 0.6


def test_kv_heads_split_or_replicated(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_llama_dir)  # 4 query heads, 2 KV heads
    assert [list(kv_head_range(cfg, 2, r)) for r in range(2)] == [[0], [1]]
    # TP 4: query heads 0-1 read KV head 0, heads 2-3 KV head 1; each KV head on two ranks
    assert [list(kv_head_range(cfg, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    other = dataclasses.replace(cfg, family="gemma", architecture="GemmaForCausalLM")
    with pytest.raises(ModelConfigError, match="not supported for GemmaForCausalLM"):
        check_split(other, 2)
    check_split(other, 1)  # one rank splits nothing
