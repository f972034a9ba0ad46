"""`draft_model` speculation on the decode worker of a prefill + decode stack with the
default model and a real draft (its first 4 layers, final norm and lm_head), through the
official openai client: greedy text equals the single-process plain engine's for a prompt
computed on the decode worker and one handed off by the prefill worker (whose draft KV the
decode worker computes itself); the decode worker's spec_decode counters count the drafts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, running_stack
from hetero_pd.models.draft_models import save_early_exit

pytestmark = pytest.mark.slow
SHORT = "Name three colors."  # computed on the decode worker
LONG = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 8  # handed off
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    draft = save_early_exit(default_model_dir, tmp_path_factory.mktemp("draft"), 4)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    workers = [{"role": "prefill"}, {"role": "decode", "speculative_config": spec}]
    dep = deployment(default_model_dir, workers=workers, engine={"num_kv_blocks": 128})
    with running_stack(dep) as s:
        yield s


def test_served_greedy_text_is_the_plain_engines(stack: Stack, default_model_dir: Path) -> None:
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate([SHORT, LONG], params)]
    del llm
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)

    def drafts() -> float:
        return stack.metric("vllm:spec_decode_num_drafts_total", worker="decode-0")

    for prompt, text in zip([SHORT, LONG], want, strict=True):
        before = drafts()
        r = client.completions.create(
            model=stack.dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.choices[0].text == text and text.strip()
        deadline = time.monotonic() + 20
        while drafts() == before and time.monotonic() < deadline:
            time.sleep(0.2)  # the decode worker's next heartbeat carries its counts
        assert drafts() > before  # this request, handed off or not, was drafted for
    stack.wait_idle()
