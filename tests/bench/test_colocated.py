"""The colocated baseline that `bench pd` compares with, served for real: `hetero-pd serve`
on configs/colocated.yaml (two `both` workers behind the router), the tiny model swapped in.

The official openai client gets the single-process engine's greedy output, both workers
take requests, and `hetero-pd bench serve` measures this real stack (its counts agree with
the server's own metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from hetero_pd import LLM, SamplingParams
from hetero_pd.bench.serve import main as bench_serve
from hetero_pd.deploy.testing import metric_value, random_prompts

REPO = Path(__file__).resolve().parents[2]
BANNER = re.compile(r"hetero-pd is serving .* at (http://\S+)/v1")

pytestmark = pytest.mark.timeout(300)


class Served:
    """`hetero-pd serve CONFIG` in a process group of its own, stopped on close."""

    def __init__(self, config: Path, timeout_s: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "hetero_pd.cli", "serve", str(config), "--no-calibrate"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_banner(timeout_s)
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as resp:
            self.model = str(json.loads(resp.read())["data"][0]["id"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_banner(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.log.append(line)
            if m := BANNER.search(line):
                return m.group(1)
        self.close()
        raise AssertionError("hetero-pd serve did not come up:\n" + "".join(self.log[-40:]))

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as resp:
            return dict(json.loads(resp.read()))

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # workers left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(text_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    raw = yaml.safe_load((REPO / "configs" / "colocated.yaml").read_text())
    assert [w["role"] for w in raw["workers"]] == ["both"] and raw["workers"][0]["count"] == 2
    raw["model"] = str(text_llama_dir)
    raw["router"]["port"] = 0
    engine = {k: v for k, v in raw["engine"].items() if k != "kv_cache_gb"}
    raw["engine"] = {**engine, "num_threads": 1, "max_model_len": 1024, "num_kv_blocks": 256}
    config = tmp_path_factory.mktemp("colocated") / "colocated.yaml"
    config.write_text(yaml.safe_dump(raw))
    s = Served(config)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def reference(text_llama_dir: Path) -> LLM:
    return LLM(
        str(text_llama_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=1
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_concurrent_greedy_equals_engine(served: Served, reference: LLM) -> None:
    lengths = [3, 17, 40, 64, 100, 200, 300, 600]  # 600: chunked prefill (512 per step)
    prompts = random_prompts(lengths, seed=5)
    max_tokens = [6 + 3 * i for i in range(len(prompts))]
    expected = [
        o.outputs[0].text for o in reference.generate(prompts, [greedy(n) for n in max_tokens])
    ]
    before = served.metrics()

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        async with client:
            rs = await asyncio.gather(*(
                client.completions.create(
                    model=served.model, prompt=p, max_tokens=n, temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p, n in zip(prompts, max_tokens, strict=True)
            ))  # fmt: skip
        return [r.choices[0].text for r in rs]

    assert asyncio.run(asyncio.wait_for(run(), 120)) == expected
    after = served.metrics()
    name = "hetero_pd_policy_decisions_total"
    decided = {
        d: metric_value(after, name, decision=d) - metric_value(before, name, decision=d)
        for d in ("colocated", "disaggregated", "local_prefill", "recompute")
    }
    assert decided == {"colocated": 8, "disaggregated": 0, "local_prefill": 0, "recompute": 0}


def test_streamed_text_prompt_equals_engine(served: Served, reference: LLM) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    prompt = "The cache moves between devices while tokens stream back"
    chunks = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.generate(prompt, greedy(12))[0].outputs[0].text


def test_both_workers_take_requests(served: Served) -> None:
    """Four long streams at once: each `both` worker is seen running one (its heartbeat
    load, through /health) before they end."""
    workers = served.health()["workers"]
    assert sorted(workers) == ["both-0", "both-1"]
    assert all(w["role"] == "both" and w["alive"] for w in workers.values())
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    done: list[int] = []

    def stream(prompt: list[int]) -> None:
        chunks = client.completions.create(
            model=served.model, prompt=prompt, max_tokens=300, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        done.append(usage[-1])

    threads = [threading.Thread(target=stream, args=(p,)) for p in random_prompts([20] * 4, 9)]
    for t in threads:
        t.start()
    seen: set[str] = set()
    while any(t.is_alive() for t in threads) and len(seen) < 2:
        health = served.health()["workers"]
        seen |= {worker_id for worker_id, w in health.items() if w["load"].get("running", 0) > 0}
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert seen == {"both-0", "both-1"}
    assert done == [300] * 4


def test_bench_serve_against_the_real_stack(
    served: Served, text_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = served.metrics()
    argv = ["--url", served.url, "--tokenizer", str(text_llama_dir), "--dataset", "random"]
    argv += ["--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "6"]
    argv += ["--rate", "inf", "--ignore-eos", "--slo", "ttft:60000", "tpot:60000"]
    assert bench_serve([*argv, "--no-initial-test", "--disable-tqdm"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    after = served.metrics()

    def served_delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert res["model"] == served.model  # discovered through GET /v1/models
    assert (res["completed"], res["failed"], res["good_requests"]) == (6, 0, 6)
    # What the client counted is what the server says it served.
    assert served_delta("hetero_pd_requests_total", outcome="length") == 6
    assert res["total_output_tokens"] == served_delta("hetero_pd_generation_tokens_total") == 48
    assert res["total_input_tokens"] == served_delta("hetero_pd_prompt_tokens_total")
    # Latencies measured on the stream, consistent with one another. Not "> 0" beyond the
    # TTFT: a busy host's router or client may take a request's 8 tokens in one read.
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"] > 0
    assert res["mean_tpot_ms"] == pytest.approx((res["mean_e2el_ms"] - res["mean_ttft_ms"]) / 7)
    assert res["mean_itl_ms"] >= 0
