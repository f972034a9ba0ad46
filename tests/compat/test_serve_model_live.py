"""`hetero-pd serve <model dir> --served-model-name ... --api-key ...` run as a user runs it
(a subprocess), answering the official `openai` client: the tiny Llama, and a tiny
DeepSeek-V3 (MLA + MoE, sharded safetensors) as a family other than Llama's."""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import metric_value, serve_process

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0
#: (model, what `auto` resolves to): Llama in both dtypes; DeepSeek-V3 once, in bfloat16
#: (what `auto` picks on a CPU with native bf16), to keep the test's time down.
SERVED = [
    pytest.param("tiny_llama_dir", "float32", id="llama-float32"),
    pytest.param("tiny_llama_dir", "bfloat16", id="llama-bfloat16"),
    pytest.param("tiny_deepseek_v3_dir", "bfloat16", id="mla-bfloat16"),
]


@pytest.fixture
def model_dir(request: pytest.FixtureRequest, model_fixture: str) -> Path:
    path: Path = request.getfixturevalue(model_fixture)
    return path


@pytest.fixture
def served(model_dir: Path, auto_dtype: str) -> Iterator[str]:
    argv = [str(model_dir), "--port", "0", "--served-model-name", "tiny", "tiny-2"]
    argv += ["--api-key", "k", "--kv-cache-gb", "0.02", "--max-model-len", "256"]
    env = {**os.environ, "HETERO_PD_API_KEY": "from-env", "PYTHONPATH": str(REPO)}
    with serve_process(argv, DEADLINE_S, env) as (proc, url):
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.dtype  # `serve MODEL`'s workers and the reference both run `auto`
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model_fixture", "auto_dtype"), SERVED, indirect=["auto_dtype"])
def test_the_openai_client_talks_to_serve_model(served: str, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-2"]
    expected = LLM(str(model_dir), num_kv_blocks=16).generate(
        "in the", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    for name in ("tiny", "tiny-2"):
        r = client.completions.create(
            model=name,
            prompt="in the",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == expected.outputs[0].text
        assert r.usage is not None and r.usage.completion_tokens == 6

    env_client = openai.OpenAI(base_url=f"{served}/v1", api_key="from-env", max_retries=0)
    assert len(env_client.models.list().data) == 2, "$HETERO_PD_API_KEY is accepted too"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(model_dir), prompt="hi", max_tokens=1)

    req = urllib.request.Request(f"{served}/metrics", headers={"Authorization": "Bearer k"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    assert metric_value(text, "hetero_pd_requests_total", model_name="tiny", outcome="length") == 2
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", model_name="tiny") == 2
    # Load comes with the workers' heartbeats: present, though not necessarily back to 0.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert re.search(rf'^{name}{{model_name="tiny"}} \d+\.0$', text, re.M), name
    assert re.search(r'^vllm:kv_cache_usage_perc{model_name="tiny"} [0-9.e-]+$', text, re.M)
