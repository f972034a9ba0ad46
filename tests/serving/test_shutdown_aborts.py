"""Shutdown with requests in flight: the API cuts them after the grace period, and the
workers abort them (their blocks freed) before the workers are stopped; on several hosts
the workers outlive the router, so a request left running there would hold its blocks."""

from __future__ import annotations

import threading
from pathlib import Path

import openai

from hetero_pd.deploy.testing import deployment, running_stack

STREAMS = 4
MAX_TOKENS = 900


def test_stopping_the_api_aborts_its_requests_on_the_workers(default_model_dir: Path) -> None:
    # The default model: its 900 tokens take far longer than the wait below, so an idle
    # worker there means the requests were aborted, not finished.
    dep = deployment(default_model_dir, supervisor={"stop_grace_s": 0})
    with running_stack(dep) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        started = threading.Semaphore(0)
        finishes: list[str | None] = []
        counts: list[int] = []

        def stream(i: int) -> None:
            seen, finish = 0, None
            try:
                for chunk in client.completions.create(
                    model=str(default_model_dir),
                    prompt=f"request {i} " * 4,
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    seen += 1
                    if seen == 1:
                        started.release()
                    finish = chunk.choices[0].finish_reason or finish
            except (openai.APIError, openai.APIConnectionError):
                pass  # cut by the shutdown
            finally:
                finishes.append(finish)
                counts.append(seen)
                if seen == 0:
                    started.release()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        stack.stop_api()
        for t in threads:
            t.join(30)
        # Cut, not finished: every request was still generating when the API stopped.
        assert finishes == [None] * STREAMS, (finishes, counts)
        # The workers are still running: each has freed every block of the cut requests.
        report = stack.wait_idle(timeout_s=5)
        assert {w: r["used_blocks"] for w, r in report.items()} == {
            "prefill-0": 0,
            "decode-0": 0,
        }
