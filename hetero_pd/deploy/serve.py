"""`hetero-pd serve CONFIG | MODEL`: on one box, supervised worker processes plus the router
and the REST API in this process; on a cluster, one part of it (`--role router | worker`); on
bare metal, one host's part (`--host-id HOST`: the workers the file lists on HOST).

MODEL (a model folder, a known name or a Hugging Face repo id) gets a 1P1D deployment built
in memory from vLLM's flag names (`hetero_pd.deploy.model_deployment`). Before anything
starts the deployment is validated against this host (devices, ports, model) and automatic
P/D counts are computed, with their reasoning printed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from hetero_pd import envs, secrets
from hetero_pd.deploy.cluster import Discover, max_model_len, run_part, watch_workers
from hetero_pd.deploy.controller import RoleController, WorkerLoad
from hetero_pd.deploy.launcher import Launcher
from hetero_pd.deploy.model_deployment import (
    add_model_arguments,
    deployment_for_model,
    is_deployment_file,
    model_flags_given,
)
from hetero_pd.deploy.plan import resolve
from hetero_pd.deploy.schema import Deployment, load_deployment
from hetero_pd.deploy.validate import validate
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.tokenizer import load_tokenizer
from hetero_pd.serving.api.app import AUTO_DECOMPRESS, ApiState, create_app, create_edge_app
from hetero_pd.serving.api.edge_tls import EdgeCert, edge_cert
from hetero_pd.serving.api.tools import ToolSettings
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.metrics import ServingMetrics
from hetero_pd.serving.router.router import Router

log = logging.getLogger("hetero_pd.serve")
#: The API's shortest wait at stop for its requests to end (stop_grace_s 0), and then for
#: the cut ones to clean up (their aborts sent).
MIN_CUT_S = 0.1
#: How long the router waits at stop for workers it did not start to read its last
#: messages (the aborts of cut requests) before it closes their sockets.
FLUSH_S = 5.0


async def serve(
    dep: Deployment,
    on_ready: Callable[[str, Launcher, Router], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    discover: Discover | None = None,
    model_names: list[str] | None = None,
    on_api_stopped: Callable[[], Awaitable[None]] | None = None,
    on_edge: Callable[[str, Path], None] | None = None,
) -> None:
    """Runs the deployment until `stop` is set (SIGINT/SIGTERM set it when it is None).
    On stop the API closes first (requests in flight get `supervisor.stop_grace_s`, then are
    cut and aborted on the workers), then `on_api_stopped` runs (tests look at the workers
    there), then the workers stop.

    Clients name the model with any of `model_names` (default: the deployment's `model`).
    With `edge.tls`, edge sessions get a TLS listener of their own; `on_edge` hears its
    URL and the certificate devices trust (before `on_ready`).

    Locally the workers are started and supervised here. With `discover` (several hosts),
    the router connects to the workers it finds instead and serves at once; /health
    answers 503 until a decode worker is up."""
    stray = len(set(dep.router.priority_api_keys) - set(dep.router.api_keys))
    if stray:
        raise ValueError(
            f"router.priority_api_keys: {stray} of them not in router.api_keys (or "
            "--api-key, HETERO_PD_API_KEY): a key may set priority only if it is an API key"
        )
    model_dir = resolve_model(dep.model)
    cfg = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    names = list(model_names or [dep.model])
    secret = deployment_secret(dep, generate=discover is None)
    router = Router(
        dep.router.router_config(dep.engine.block_size),
        RouterKeys.from_secret(secret),
        ServingMetrics(model_name=names[0]),
    )
    launcher = Launcher(dep, router, secret) if discover is None else None
    stop = stop or _signal_event()
    runner: web.AppRunner | None = None
    edge: tuple[web.AppRunner, EdgeCert] | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        if launcher is not None:
            await launcher.start()
            max_len = min(w.info.max_model_len for w in router.workers.values())
        else:
            assert discover is not None
            watch = watch_workers(router, discover, dep.router.heartbeat_timeout_s)
            tasks.append(asyncio.create_task(watch))
            max_len = max_model_len(dep, cfg)
        if router.cfg.rebalance.enabled:
            tasks.append(asyncio.create_task(router.rebalancer.run()))
        if dep.supervisor.role_switch:
            tasks.append(asyncio.create_task(_controller(dep, router, launcher).run()))
        state = ApiState(
            router,
            tokenizer,
            names,
            max_len,
            cfg.vocab_size,
            dep.router.api_keys,
            dep.router.priority_api_keys,
            model_dir=Path(model_dir),
            write_timeout_s=dep.router.write_timeout_s,
            admin_keys=dep.router.admin_keys,
            tools=ToolSettings.for_tokenizer(
                dep.router.tool_call_parser, dep.router.enable_auto_tool_choice, tokenizer
            ),
            restart=launcher.restart_any if launcher is not None else None,
            remove=launcher.remove if launcher is not None else None,
        )
        # On stop, requests in flight get stop_grace_s to finish; then they are cut (their
        # generators closed: each sends its workers an Abort). aiohttp reads a timeout of 0
        # as none at all (it waited for every request to end), so 0 is the shortest wait.
        runner = web.AppRunner(
            create_app(state),
            auto_decompress=AUTO_DECOMPRESS,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=max(dep.supervisor.stop_grace_s, MIN_CUT_S),
        )
        await runner.setup()
        site = web.TCPSite(runner, dep.router.host, dep.router.port)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        url = f"http://{dep.router.host}:{port}"
        if dep.edge is not None and dep.edge.tls:
            grace = max(dep.supervisor.stop_grace_s, MIN_CUT_S)
            edge = await _edge_listener(dep, state, grace)
            if on_edge is not None:
                on_edge(state.edge_tls_url, edge[1].cert)
        if on_ready is not None and launcher is not None:
            result = on_ready(url, launcher, router)
            if result is not None:
                await result
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if edge is not None:
            await edge[0].cleanup()
            edge[1].remove()
        if runner is not None:
            await runner.cleanup()
        if on_api_stopped is not None:
            await on_api_stopped()
        if launcher is not None:
            await launcher.stop()
        # Workers we did not start go on: they must read the aborts first.
        await router.close(flush_s=0.0 if launcher is not None else FLUSH_S)


async def _edge_listener(
    dep: Deployment, state: ApiState, grace_s: float
) -> tuple[web.AppRunner, EdgeCert]:
    """Edge sessions over TLS on `edge.port` (`hetero_pd.serving.api.edge_tls`); the API's
    own port then refuses them, naming this one."""
    assert dep.edge is not None
    cert = edge_cert(dep.edge.tls_cert, dep.edge.tls_key, dep.router.host)
    runner = web.AppRunner(
        create_edge_app(state),
        auto_decompress=AUTO_DECOMPRESS,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=grace_s,
    )
    try:
        await runner.setup()
        site = web.TCPSite(
            runner, dep.router.host, dep.edge.port, ssl_context=cert.server_context()
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        cert.remove()
        raise
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    state.edge_tls_url = f"https://{dep.router.host}:{port}"
    log.info("edge sessions over TLS at %s; devices trust %s", state.edge_tls_url, cert.cert)
    return runner, cert


def deployment_secret(dep: Deployment, generate: bool) -> bytes:
    """The deployment secret: `HETERO_PD_SECRET`, else the file's `transfer.secret`, else
    (one box only, `generate`) a fresh random one for this run."""
    secret = secrets.from_env(required=False)
    if not secret and dep.transfer.secret:
        secret = secrets.check(dep.transfer.secret.encode())
    if not secret and generate:
        secret = secrets.generate().encode()
    if not secret:
        secret = secrets.from_env()  # raises, saying where the secret comes from
    return secret


def _controller(dep: Deployment, router: Router, launcher: Launcher | None) -> RoleController:
    def loads() -> list[WorkerLoad]:
        return [
            WorkerLoad.of(w.worker_id, w.role, w.load) for w in router.live("prefill", "decode")
        ]

    switch = router.switch_role if launcher is None else launcher.switch_role
    return RoleController(loads, switch, dep.supervisor, dep.engine.max_num_batched_tokens)


def _signal_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, event.set)
    return event


def _banner(name: str) -> Callable[[str, Launcher, Router], None]:
    def show(url: str, launcher: Launcher, router: Router) -> None:
        pids = launcher.pids()
        roles = ", ".join(
            f"{w.worker_id} on {w.info.device} (pid {pids[w.worker_id]})"
            for w in router.workers.values()
        )
        auth = " -H 'Authorization: Bearer $KEY'" if launcher.dep.router.api_keys else ""
        print(
            f"hetero-pd is serving {launcher.dep.model} as {name!r} at {url}/v1  "
            f"[workers: {roles}]\n"
            f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} \\\n"
            f'    -d \'{{"model": "{name}", "messages": '
            f'[{{"role": "user", "content": "Name three colors."}}], "max_tokens": 32}}\'\n'
            "`hetero-pd status --url URL` shows the workers; Ctrl-C stops it.",
            flush=True,
        )

    return show


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-pd serve", description=__doc__)
    p.add_argument(
        "target",
        metavar="CONFIG_OR_MODEL",
        help="deployment YAML (configs/local.yaml), model folder, known model name "
        "(smollm2-135m-instruct) or Hugging Face repo id",
    )
    p.add_argument(
        "--host",
        help="the address to bind: router.host (default 127.0.0.1), or a worker pod's IP "
        "(--role worker)",
    )
    p.add_argument("--port", type=int, help="override router.port (0: any free port)")
    p.add_argument(
        "--role",
        choices=["all", "router", "worker"],
        default="all",
        help="all: router + supervised worker processes on this box (default); router / "
        "worker: one part of a cluster deployment (see `hetero-pd render k8s`)",
    )
    p.add_argument("--host-id", help="bare metal: run the workers the file lists on this host")
    p.add_argument("--worker-id", help="worker role: its id (decode-1) or its pod's name")
    p.add_argument("--alive-file", default="", help="worker role: touched on each heartbeat")
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="automatic P/D counts from the capability profile, without timing the model",
    )
    add_model_arguments(p)
    return p


def load_target(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Deployment, str]:
    """The deployment `serve TARGET` runs, with the command line's overrides, and the model
    name clients send by default."""
    if is_deployment_file(args.target):
        given = model_flags_given(args)
        if given:
            p.error(
                f"{', '.join(given)}: these flags build a deployment for a model "
                f"(serve MODEL); {args.target} is a deployment file, set them in it "
                "(dtype:, workers:, engine:)"
            )
        dep = load_deployment(args.target)
        name = dep.model
    else:
        dep = deployment_for_model(args.target, args)
        name = args.target
    router = dep.router
    if args.host is not None:
        router = replace(router, host=args.host)
    if args.port is not None:
        router = replace(router, port=args.port)
    keys = (*router.api_keys, *_flag_api_keys(p, args), *envs.api_keys())
    vip = (*router.priority_api_keys, *envs.priority_api_keys())
    ops = (*router.admin_keys, *envs.admin_keys())
    router = replace(
        router,
        api_keys=tuple(dict.fromkeys(keys)),
        priority_api_keys=tuple(dict.fromkeys(vip)),
        admin_keys=tuple(dict.fromkeys(ops)),
    )
    return replace(dep, router=router), name


def _flag_api_keys(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The keys of --api-key-file and --api-key (which is visible to every local user)."""
    keys = []
    if args.api_key_file:
        try:
            text = Path(args.api_key_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--api-key-file {args.api_key_file}: {e}")
        keys = [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]
    if args.api_key:
        print(
            "warning: --api-key puts the key on the command line, where any user of this "
            "machine can read it (ps, /proc); use --api-key-file or HETERO_PD_API_KEY",
            file=sys.stderr,
        )
        keys.append(args.api_key)
    return keys


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dep, default_name = load_target(p, args)
    names = list(args.served_model_name or [default_name])
    if args.role != "all" or args.host_id or any(w.host for w in dep.workers):
        if args.role == "worker" and not (args.worker_id and args.host):
            p.error("--role worker needs --worker-id and --host (its pod's name and IP)")
        return run_part(dep, args, lambda d, find: serve(d, discover=find, model_names=names))
    dep, plan = resolve(dep, use_calibration=not args.no_calibrate)
    if plan is not None:
        print(plan.explain(), flush=True)
    for warning in validate(dep, "local").warnings:
        print(f"warning: {warning}", flush=True)
    asyncio.run(serve(dep, on_ready=_banner(names[0]), model_names=names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
