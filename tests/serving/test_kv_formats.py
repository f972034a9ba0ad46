"""Workers of one deployment in different KV formats, through real processes and sockets:
a bfloat16 prefill worker whose KV cache is in the NPU's fractal_nz layout (emulated on the
CPU) hands its KV to decode workers in the standard nd layout, converted on receipt; and a
decode worker of another model is refused at link time."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy import launcher
from hetero_pd.deploy.testing import SMALL_ENGINE, deployment, random_prompts, running_stack
from hetero_pd.models.fingerprint import model_fingerprint

DECISIONS = "hetero_pd_policy_decisions_total"
NPU_PREFILL = {"role": "prefill", "dtype": "bfloat16", "kv_layout": "fractal_nz"}
# Longer than router.local_prefill_max_tokens (32): every prompt is prefilled remotely.
LENGTHS = [40, 57, 90, 128, 200, 33]
MAX_TOKENS = 10
#: The float32 decode worker computes every step after the first in float32 on bfloat16 KV;
#: the reference computes them in bfloat16. Tokens are equal up to a near tie, where the
#: reference's choice must be the decode worker's runner-up within LOGPROB_TOLERANCE nats;
#: until then the chosen tokens' logprobs agree within the same tolerance. (Measured on the
#: tiny model, whose logprobs are all near -ln(512): differences up to ~0.004 nats, one near
#: tie, 0.0012 nats apart, in 60 tokens.)
LOGPROB_TOLERANCE = 0.02


def _reference(model: Path, dtype: str, prompts: list[list[int]]) -> list[Any]:
    """Greedy outputs (with the chosen tokens' logprobs) of one engine in `dtype`, nd."""
    llm = LLM(str(model), dtype=dtype, **{**SMALL_ENGINE, "max_num_seqs": 8})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _served(url: str, model: str, prompts: list[list[int]]) -> list[Any]:
    """Each prompt's completion logprobs object (tokens as text, chosen and top-2 logprobs)."""

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(
                client.completions.create(
                    model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                    extra_body={"ignore_eos": True},
                )
                for p in prompts
            ))  # fmt: skip

    return [r.choices[0].logprobs for r in asyncio.run(asyncio.wait_for(run(), 120))]


def _run(model: Path, decode_dtype: str, transport: str, prompts: list[list[int]]) -> list[Any]:
    dep = deployment(
        model,
        workers=[NPU_PREFILL, {"role": "decode", "dtype": decode_dtype}],
        transfer={"transports": [transport]},
    )
    with running_stack(dep) as stack:
        served = _served(stack.base_url, stack.dep.model, prompts)
        assert stack.metric(DECISIONS, decision="disaggregated") == len(prompts)
        assert stack.metric(DECISIONS, decision="recompute") == 0
        stack.wait_idle()
    return served


def test_bf16_npu_layout_prefill_to_bf16_nd_decode_equals_one_engine(tiny_llama_dir: Path) -> None:
    """Layout conversion alone (fractal_nz -> nd) loses nothing: one bf16 engine's tokens."""
    prompts = random_prompts(LENGTHS, seed=130)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    reference = _reference(tiny_llama_dir, "bfloat16", prompts)
    served = _run(tiny_llama_dir, "bfloat16", "tcp", prompts)
    for got, ref in zip(served, reference, strict=True):
        assert got.tokens == [tokenizer.decode([i]) for i in ref.token_ids]
        lps = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
        # The workers batch prompts and steps differently from the reference, which rounds
        # differently in bfloat16 (measured up to 0.004 nats): the tokens are the same.
        assert got.token_logprobs == pytest.approx(lps, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize(
    ("model_fixture", "transport", "tolerance"),
    [
        ("tiny_llama_dir", "tcp", LOGPROB_TOLERANCE),
        ("tiny_llama_dir", "shm", LOGPROB_TOLERANCE),
        # MLA's latent rows (kv_lora_rank + rope = 48 wide) in fractal_nz, then float32 nd.
        # Its logits spread wider than the tiny Llama's (routed scaling, random norms), so
        # float32 steps stand further from bfloat16 ones: measured 0.038 nats.
        ("tiny_deepseek_v3_dir", "tcp", 0.08),
        # Qwen3-MoE (q/k norms, experts) over shm: measured 0.0044 nats.
        ("tiny_qwen3_moe_dir", "shm", LOGPROB_TOLERANCE),
        ("tiny_qwen3_dir", "tcp", LOGPROB_TOLERANCE),
        ("tiny_mixtral_dir", "shm", LOGPROB_TOLERANCE),
    ],
)
def test_bf16_npu_layout_prefill_to_float32_nd_decode(
    model_fixture: str, transport: str, tolerance: float, request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    prompts = random_prompts(LENGTHS, seed=131)
    reference = _reference(model, "bfloat16", prompts)
    served = _run(model, "float32", transport, prompts)
    tokenizer = AutoTokenizer.from_pretrained(model)
    worst, ties = 0.0, 0
    for got, ref in zip(served, reference, strict=True):
        want = [tokenizer.decode([i]) for i in ref.token_ids]
        # The first token is sampled by the bfloat16 prefill worker: exactly the reference's.
        assert got.tokens[0] == want[0]
        for i, (token, ref_token) in enumerate(zip(got.tokens, want, strict=True)):
            if token != ref_token:  # a near tie broken the other way: the rest may differ
                gap = got.token_logprobs[i] - got.top_logprobs[i].get(ref_token, -1e9)
                assert 0 <= gap <= tolerance, (i, got.tokens, want, got.top_logprobs[i])
                ties += 1
                break
            ref_lp = ref.logprobs[i][ref.token_ids[i]].logprob
            worst = max(worst, abs(got.token_logprobs[i] - ref_lp))
    assert worst <= tolerance, worst
    assert ties <= len(prompts) // 2, ties  # a few near ties, not a different model
    print(f"float32 decode vs bfloat16 engine: max |dlogprob| {worst:.4f}, near ties {ties}")


def test_decode_worker_of_another_model_is_refused_at_link_time(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode worker loads other weights with the same KV shape: without the check its
    KV would be accepted and the answer wrong. The link is refused, the request fails with
    a clear 503 naming both fingerprints (failure_policy: fail), nothing is leaked."""
    dep = deployment(tiny_llama_dir, router={"failure_policy": "fail"})
    configs = launcher.worker_configs

    def other_decode_model(d: Any) -> list[Any]:
        return [
            dataclasses.replace(c, engine=dataclasses.replace(c.engine, model=str(tiny_qwen2_dir)))
            if c.role == "decode"
            else c
            for c in configs(d)
        ]

    monkeypatch.setattr(launcher, "worker_configs", other_decode_model)
    ours, theirs = model_fingerprint(tiny_llama_dir), model_fingerprint(tiny_qwen2_dir)
    assert ours != theirs
    (prompt,) = random_prompts([60], seed=132)
    with running_stack(dep) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=stack.dep.model, prompt=prompt, max_tokens=4)
        err = info.value.response.json()["error"]
        assert info.value.status_code == 503 and err["code"] == "prefill_failed", err
        assert "fingerprints differ" in err["message"], err
        assert ours in err["message"] and theirs in err["message"], err
        stack.wait_idle()
