"""`hetero-pd drill multihost`: the multi-host drill for an operator, with its numbers.

    sudo hetero-pd drill multihost                      # Kubernetes mode, the default model
    sudo hetero-pd drill multihost --mode bare-metal --model ./my-model --requests 16

Brings the deployment up across network-namespace hosts (`hetero_pd.deploy.drill`),
checks the greedy answers against the single-process engine (streamed and not), measures
each request one at a time over the veth link (TTFT, TPOT, KV bytes and transfer time, from
the client and the router's /metrics), then, in Kubernetes mode, kills a prefill pod and
the decode pod under load (-9), replaces them and scales decode up. Exit status 0 when
every check held, 1 otherwise, 2 when namespaces cannot be made here (needs root).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from typing import Any

from hetero_pd.config import EngineConfig
from hetero_pd.deploy import drill_client, netns
from hetero_pd.deploy.drill import (
    Cluster,
    DrillError,
    DrillSpec,
    add_worker,
    bare_metal_cluster,
    k8s_cluster,
)
from hetero_pd.deploy.drill_client import Answer, sequential, transferred_cleanly, under_load
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.testing import random_prompts
from hetero_pd.engine.tp.group import rank_pids


def main(argv: list[str] | None = None) -> int:
    from hetero_pd.models.fetch import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="hetero-pd drill multihost", description=__doc__)
    p.add_argument("what", choices=["multihost"])
    p.add_argument("--model", default=DEFAULT_MODEL, help="known name or local folder")
    p.add_argument("--mode", choices=["k8s", "bare-metal"], default="k8s")
    p.add_argument("--prefill", type=int, default=2, help="prefill hosts")
    p.add_argument("--decode", type=int, default=1, help="decode hosts")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks of every worker (on the CPU the ranks share their host's threads)",
    )
    p.add_argument("--requests", type=int, default=8, help="measured requests")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-faults", action="store_true", help="skip the kill -9 and scale-up")
    p.add_argument(
        "--exec-pods",
        action="store_true",
        help="start each pod's command in a fresh interpreter, as a kubelet does (default: "
        "forked, with the same arguments and environment, from a process that imported "
        "hetero-pd once)",
    )
    p.add_argument("--keep", action="store_true", help="keep manifests and logs (printed)")
    args = p.parse_args(argv)
    reason = netns.unavailable()
    if reason is not None:
        print(f"hetero-pd drill: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    spec = DrillSpec(
        args.model,
        args.prefill,
        args.decode,
        tensor_parallel_size=args.tensor_parallel_size,
        fork_pods=not args.exec_pods,
    )
    start = time.monotonic()
    try:
        cluster = k8s_cluster(spec) if args.mode == "k8s" else bare_metal_cluster(spec)
    except DrillError as e:
        print(f"hetero-pd drill: the deployment did not come up: {e}", file=sys.stderr)
        return 1
    cluster.keep = args.keep
    try:
        say(f"hetero-pd drill multihost ({args.mode}): {spec.model}, up in {_since(start)}")
        say(f"  cpu: {_cpu()}; hosts: " + ", ".join(
            f"{h.name} {h.address}" for h in cluster.lab.hosts.values()
        ))  # fmt: skip
        ok = _run(cluster, args)
    except (DrillError, TimeoutError) as e:
        say(f"FAILED: {e}")
        ok = False
    finally:
        if args.keep:
            say(f"manifests and logs: {cluster.workdir}")
        cluster.close()
    return 0 if ok else 1


def say(text: str) -> None:
    print(text, flush=True)


def _run(cluster: Cluster, args: argparse.Namespace) -> bool:
    prompts = random_prompts([args.prompt_len] * args.requests, seed=7, vocab=_vocab(cluster))
    expected = _reference(cluster, prompts, args.max_tokens)
    ok = True
    if args.tensor_parallel_size > 1:
        ranks = {w: 1 + len(rank_pids(pid)) for w, pid in cluster.pids().items()}
        ok &= _check(f"every worker runs {args.tensor_parallel_size} tensor-parallel ranks",
                     set(ranks.values()) == {args.tensor_parallel_size}, str(ranks))  # fmt: skip
    for stream in (False, True):
        got = [cluster.call(cluster.api.complete, q, args.max_tokens, stream) for q in prompts]
        same = sum(a.text == e for a, e in zip(got, expected, strict=True))
        ok &= _check(f"greedy == single-process engine ({'streamed' if stream else 'whole'})",
                     same == len(prompts), f"{same}/{len(prompts)}")  # fmt: skip
    # Prompts the decode worker has not seen: a cached prefix would not be sent again.
    fresh = random_prompts([args.prompt_len] * args.requests, seed=8, vocab=_vocab(cluster))
    rows = cluster.call(sequential, cluster.api, fresh, args.max_tokens)
    _numbers(rows)
    clean = all(transferred_cleanly(r) for r in rows)
    ok &= _check("every measured request prefilled remotely, KV over the link", clean, "")
    if args.no_faults or args.mode != "k8s":
        return ok
    return _faults(cluster, prompts, expected, args.max_tokens) and ok


def _faults(cluster: Cluster, prompts: list[list[int]], expected: list[str], n: int) -> bool:
    ok, api = True, cluster.api
    for pod, concurrency in (("prefill-0", 4), ("decode-0", len(prompts))):
        before, t0 = cluster.pids(), time.monotonic()
        answers: list[Answer] = cluster.call(
            under_load, api, prompts, n if pod.startswith("prefill") else 4 * n, concurrency,
            lambda pod=pod: cluster.kill(pod),
        )  # fmt: skip
        right = sum(a.text == e for a, e in zip(answers, expected, strict=True))
        errors = [a.error for a in answers if a.error]
        clear = all(pod in e for e in errors)
        ok &= _check(f"kill -9 {pod} under load", clear, f"{right} right, {len(errors)} "
                     f"ended with a clear error, in {_since(t0)}")  # fmt: skip
        cluster.run(pod)
        t1 = time.monotonic()
        cluster.wait_workers({pod}, pids=before)
        rows = cluster.call(sequential, api, prompts[:2], n)
        slowest = max(r["kv_seconds"] for r in rows) * 1e3
        ok &= _check(f"{pod} replaced, next requests transferred without a timeout",
                     all(transferred_cleanly(r) for r in rows),
                     f"back in {_since(t1)}, slowest transfer {slowest:.0f} ms")  # fmt: skip
    new = f"decode-{sum(1 for w in cluster.pods if w.startswith('decode'))}"
    t2 = time.monotonic()
    add_worker(cluster, new)
    cluster.wait_workers({new})
    ok &= _check(f"scale-up: {new} seen by the router", True, f"in {_since(t2)}")
    status, _ = cluster.call(drill_client.Api(api.url, "", api.model).get, "/v1/models")
    return _check("the API refuses a request without the key", status == 401, str(status)) and ok


def _numbers(rows: list[dict[str, Any]]) -> None:
    answers = [r["answer"] for r in rows]
    ttft = [a.ttft_s * 1e3 for a in answers]
    tpot = [a.tpot_s * 1e3 for a in answers]
    kv = [r["kv_bytes"] for r in rows]
    ms = [r["kv_seconds"] * 1e3 for r in rows]
    say(f"  per request, one at a time over the veth link ({len(rows)} requests):")
    say(f"    TTFT ms      p50 {_pct(ttft, 50):8.1f}  p99 {_pct(ttft, 99):8.1f}")
    say(f"    TPOT ms      p50 {_pct(tpot, 50):8.2f}  p99 {_pct(tpot, 99):8.2f}")
    say(f"    KV bytes     p50 {_pct(kv, 50):8.0f}  p99 {_pct(kv, 99):8.0f}")
    say(f"    transfer ms  p50 {_pct(ms, 50):8.2f}  p99 {_pct(ms, 99):8.2f}")


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def _check(what: str, ok: bool, detail: str) -> bool:
    say(f"  {'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""))
    return ok


def _reference(cluster: Cluster, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The single-process engine's greedy answers (in this process, on this host)."""
    from hetero_pd import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(reference_config(cluster.dep, _model_dir(cluster))))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def reference_config(dep: Deployment, model: str) -> EngineConfig:
    """The single-process engine's config: the deployment's engine section and the dtype
    its pods run (the section's, else the deployment's; `LLM` alone would resolve `auto`,
    which is not what the pods run)."""
    return dep.engine.engine_config(model, dtype=dep.engine.dtype or dep.dtype)


def _model_dir(cluster: Cluster) -> str:
    from hetero_pd.models.fetch import resolve_model

    return str(resolve_model(cluster.model))


def _vocab(cluster: Cluster) -> int:
    from hetero_pd.models.config import ModelConfig

    return min(ModelConfig.from_dir(_model_dir(cluster)).vocab_size, 32000)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line for line in f if line.startswith("model name"))
        return name.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _since(t: float) -> str:
    return f"{time.monotonic() - t:.1f} s"
