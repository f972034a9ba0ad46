"""`draft_model` speculation on the decode workers of a prefill + decode stack of the tiny
Llama, through the official openai client, with three drafts: an early exit (its first 2 of
3 layers, final norm and lm_head: partly accepted), a random model of its vocabulary
(nearly all rejected) and the model itself (nearly all accepted). Greedy text and
the logprobs of its tokens equal the single-process plain engine's for a prompt computed
on the decode worker and one handed off by the prefill worker (whose draft KV the decode
worker computes itself); the decode worker's spec_decode counters count the drafts.

One stack serves all three: a decode worker per draft (decode-0, -1, -2 in DRAFTS' order),
each test keeping the other two out of rotation (drained) while it runs, so that its
requests, and its worker's counters, are its draft's alone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, http_json, random_prompts, running_stack
from hetero_pd.models.draft_models import save_early_exit, save_random_draft

pytestmark = pytest.mark.slow
# Token ids (the tiny model's vocabulary is 512): SHORT is computed on the decode worker, LONG
# (longer than router.local_prefill_max_tokens) is handed off by the prefill worker.
SHORT, LONG = random_prompts([9, 60], seed=11)
MAX_TOKENS = 12
TOL = 1e-4

#: draft name -> the draft's folder, built from the target's into a fresh folder
DRAFTS: dict[str, Callable[[Path, Path], Path]] = {
    "early_exit": lambda target, dest: save_early_exit(target, dest, 2),
    "random": save_random_draft,
    "self": lambda target, dest: target,
}
#: draft name -> bounds of accepted / drafted tokens: the draft that is the target proposes
#: its tokens only while its KV keeps in step with the target's sequence
ACCEPTANCE = {"early_exit": (0.0, 1.0), "random": (0.0, 0.25), "self": (0.95, 1.0)}


@pytest.fixture(scope="module")
def want(tiny_llama_dir: Path) -> list[tuple[str, list[float]]]:
    """The plain engine's text and token logprobs for SHORT and LONG."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    out = []
    for o in llm.generate([SHORT, LONG], params):
        (c,) = o.outputs
        assert c.logprobs is not None
        out.append((c.text, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)]))
    return out


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workers: list[dict[str, object]] = [{"role": "prefill"}]
    for make in DRAFTS.values():
        folder = make(tiny_llama_dir, tmp_path_factory.mktemp("draft"))
        spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
        workers.append({"role": "decode", "speculative_config": spec})
    dep = deployment(tiny_llama_dir, workers=workers, engine={"num_kv_blocks": 128})
    with running_stack(dep) as s:
        yield s


@contextlib.contextmanager
def only(stack: Stack, worker: str) -> Iterator[None]:
    """Keeps every decode worker but `worker` out of rotation (drained) meanwhile."""
    others = [f"decode-{i}" for i in range(len(DRAFTS)) if f"decode-{i}" != worker]
    try:
        for other in others:
            assert http_json(f"{stack.url}/admin/drain", {"worker": other})[0] == 200
        yield
    finally:
        for other in others:
            http_json(f"{stack.url}/admin/undrain", {"worker": other})


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_served_greedy_text_and_logprobs_are_the_plain_engines(
    stack: Stack, draft: str, want: list[tuple[str, list[float]]]
) -> None:
    worker = f"decode-{list(DRAFTS).index(draft)}"
    with only(stack, worker):
        check_draft(stack, draft, worker, want)


def check_draft(stack: Stack, draft: str, worker: str, want: list[tuple[str, list[float]]]) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)

    def counts() -> tuple[float, float]:
        drafted = stack.metric("vllm:spec_decode_num_draft_tokens_total", worker=worker)
        accepted = stack.metric("vllm:spec_decode_num_accepted_tokens_total", worker=worker)
        return drafted, accepted

    for prompt, (text, logprobs) in zip([SHORT, LONG], want, strict=True):
        before = counts()[0]
        r = client.completions.create(
            model=stack.dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"ignore_eos": True},
        )  # fmt: skip
        (choice,) = r.choices
        assert choice.text == text and text.strip()
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        got = choice.logprobs.token_logprobs
        assert len(got) == len(logprobs)
        assert all(abs(g - w) < TOL for g, w in zip(got, logprobs, strict=True)), (got, logprobs)
        deadline = time.monotonic() + 20
        while counts()[0] == before and time.monotonic() < deadline:
            time.sleep(0.05)  # the decode worker's next heartbeat carries its counts
        assert counts()[0] > before  # this request, handed off or not, was drafted for
    stack.wait_idle()
    drafted, accepted = counts()
    low, high = ACCEPTANCE[draft]
    assert low * drafted <= accepted <= high * drafted, (drafted, accepted)
