"""A worker with tensor_parallel_size 2: the deployment file and `serve MODEL -tp 2` take
it, it takes two devices, it serves the single-process engine's tokens as one worker, and a
rank killed under load takes the worker down to be restarted, every request ending."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from backends import get_backend
from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.cluster import pod_worker_config
from hetero_pd.deploy.k8s import render
from hetero_pd.deploy.model_deployment import deployment_for_model
from hetero_pd.deploy.schema import ConfigError, parse_deployment, parse_text
from hetero_pd.deploy.sections import DEVICE_RESOURCES
from hetero_pd.deploy.serve import build_parser
from hetero_pd.deploy.testing import deployment, random_prompts, running_stack
from hetero_pd.deploy.validate import validate_file
from hetero_pd.deploy.workers import expand_workers
from hetero_pd.engine.tp.group import rank_pids


def _dep(workers: list[dict[str, object]]) -> dict[str, object]:
    return {"model": "m", "workers": workers}


def test_a_tp_worker_takes_consecutive_devices() -> None:
    dep = parse_deployment(
        _dep([{"role": "both", "device": "cuda", "count": 2, "tensor_parallel_size": 2}])
    )
    assert [(w.device, w.tensor_parallel_size) for w in expand_workers(dep.workers)] == [
        ("cuda:0", 2),
        ("cuda:2", 2),
    ]
    with pytest.raises(ConfigError, match=r"cuda:2 is already used by workers\[0\]"):
        parse_deployment(
            _dep(
                [
                    {"role": "both", "device": "cuda:1", "tensor_parallel_size": 2},
                    {"role": "both", "device": "cuda:2"},
                ]
            )
        )
    yaml_text = "model: m\nworkers:\n- {role: both, device: cuda, tensor_parallel_size: 2}\n"
    manifests = render(parse_text(yaml_text))
    pods = [m for m in manifests if m["kind"] == "StatefulSet"]
    limits = pods[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2


@pytest.mark.parametrize(
    ("kind", "resource", "selector"),
    [
        ("cuda", "nvidia.com/gpu", {"nvidia.com/gpu.present": "true"}),
        ("npu", "huawei.com/Ascend910", {"accelerator": "ascend-910b"}),
    ],
)
def test_a_tp_pod_requests_all_its_devices(
    kind: str, resource: str, selector: dict[str, str]
) -> None:
    """Each pod of a TP 2 worker asks the device plugin for two devices (requests and
    limits alike: extended resources must not be overcommitted), lands on a node that has
    them, and its worker runs its ranks on the pod's devices 0 and 1."""
    text = (
        f"model: m\nworkers:\n- {{role: both, device: {kind}, count: 2, tensor_parallel_size: 2}}\n"
    )
    dep = parse_text(text)
    (pods,) = [m for m in render(dep) if m["kind"] == "StatefulSet"]
    assert pods["spec"]["replicas"] == 2
    spec = pods["spec"]["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["requests"][resource] == resources["limits"][resource] == 2
    assert set(DEVICE_RESOURCES.values()) & set(resources["limits"]) == {resource}
    assert spec["nodeSelector"] == selector
    assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for worker_id in ("both-0", "both-1"):  # each pod sees its own two devices from 0
        cfg = pod_worker_config(dep, worker_id, "", "10.1.2.3")
        assert (cfg.engine.device, cfg.engine.tensor_parallel_size) == (f"{kind}:0", 2)


@pytest.mark.parametrize(
    ("worker", "key", "message"),
    [
        (
            {"role": "prefill", "device": "cuda", "tensor_parallel_size": 2},
            r"workers\[0\]\.tensor_parallel_size",
            "on the CPU only so far",
        ),
        (
            {"role": "prefill", "kv_layout": "fractal_nz", "tensor_parallel_size": 2},
            r"workers\[0\]\.kv_layout",
            "slice of one nd cache",
        ),
        ({"role": "both", "tensor_parallel_size": 0}, r"workers\[0\]\.tensor_parallel_size", ""),
        (
            {"role": "both", "devices": ["cuda:0", "cuda:1"], "tensor_parallel_size": 2},
            r"workers\[0\]\.devices",
            "consecutive devices",
        ),
    ],
)
def test_unsupported_tp_workers_are_named(
    worker: dict[str, object], key: str, message: str
) -> None:
    workers = [worker] if worker["role"] != "prefill" else [worker, {"role": "decode"}]
    with pytest.raises(ConfigError, match=f"(?s){key}.*{message}"):
        parse_deployment(_dep(workers))


def test_serve_model_flag(tiny_llama_dir: Path) -> None:
    model = str(tiny_llama_dir)

    def serve_args(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args([model, *flags])

    dep = deployment_for_model(model, serve_args("--colocated", "-tp", "2"))
    assert [w.tensor_parallel_size for w in dep.workers] == [2]
    dep = deployment_for_model(model, serve_args("--tensor-parallel-size", "2"))
    assert [(w.role, w.tensor_parallel_size) for w in dep.workers] == [
        ("prefill", 2),
        ("decode", 2),
    ]
    with pytest.raises(ValueError, match="--tensor-parallel-size: 2 on a prefill worker on cuda"):
        deployment_for_model(model, serve_args("--tensor-parallel-size", "2", "--device", "cuda"))


def _ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes worker `pid` started."""
    return rank_pids(pid)


def test_served_tp2_worker_and_a_killed_rank(tiny_qwen3_dir: Path) -> None:
    prompts = random_prompts([7, 19, 3], seed=11)
    llm = LLM(str(tiny_qwen3_dir), dtype="float32", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    dep = deployment(
        tiny_qwen3_dir,
        workers=[{"role": "both", "tensor_parallel_size": 2}],
        supervisor={"backoff_s": 0.1},
    )
    with running_stack(dep) as stack:
        assert stack.router is not None and stack.launcher is not None
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)

        def complete(prompt: list[int], max_tokens: int = 8) -> str:
            r = client.completions.create(
                model=dep.model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        assert [complete(p) for p in prompts] == want
        old = stack.launcher.pid("both-0")
        assert old is not None
        ranks = _ranks_of(old)
        assert len(ranks) == 1
        # Under load: long requests in flight when rank 1 dies; each one ends.
        ended: list[str] = []

        def long_request(prompt: list[int]) -> None:
            try:
                complete(prompt, max_tokens=400)
                ended.append("completed")
            except openai.APIError as e:
                ended.append(f"error: {e}")

        threads = [threading.Thread(target=long_request, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while stack.router.workers["both-0"].load.running == 0:  # they are decoding
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.02)
        os.kill(ranks[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a request outlived its worker's rank"
        assert len(ended) == len(prompts)
        while (state := stack.router.supervision_of("both-0"))["state"] != "running" or (
            state["pid"] == old or not stack.router.live("both")
        ):
            assert time.monotonic() < deadline + 120, "the worker group was never restarted"
            time.sleep(0.1)
        assert state["restarts"] >= 1, state
        assert [complete(p) for p in prompts] == want
        assert len(_ranks_of(state["pid"])) == 1
    assert not _ranks_of(old)


def test_validate_counts_every_device_of_a_tp_worker(
    write_yaml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host with one GPU, a TP 2 worker from cuda:0 lacks cuda:1, and says so."""
    monkeypatch.setattr(type(get_backend("cuda")), "device_count", lambda self: 1)
    path = write_yaml(
        "model: smollm2-135m-instruct\n"
        "workers:\n  - role: both\n    device: cuda:0\n    tensor_parallel_size: 2\n"
    )
    with pytest.raises(ConfigError, match=r"workers\[0\]\.device: cuda:1: this host has 1 cuda"):
        validate_file(path, "local", check_ports=False)
