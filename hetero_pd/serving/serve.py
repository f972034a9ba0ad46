"""`hetero-pd serve CONFIG`: workers as processes, the router and the REST API in this one."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace

from aiohttp import web

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.api import ApiState, create_app
from hetero_pd.serving.deploy_config import Deployment, load_deployment
from hetero_pd.serving.launcher import Launcher
from hetero_pd.serving.policy import RoutingConfig
from hetero_pd.serving.router import Router, RouterConfig

log = logging.getLogger("hetero_pd.serve")


def router_config(dep: Deployment) -> RouterConfig:
    r = dep.router
    return RouterConfig(
        routing=RoutingConfig(
            policy=r.policy,  # type: ignore[arg-type]
            local_prefill_max_tokens=r.local_prefill_max_tokens,
            block_size=int(dep.engine.get("block_size", 16)),
        ),
        failure_policy=r.failure_policy,  # type: ignore[arg-type]
        max_inflight=r.max_inflight,
        heartbeat_timeout_s=r.heartbeat_timeout_s,
    )


async def serve(
    dep: Deployment,
    on_ready: Callable[[str, Launcher, Router], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs the deployment until `stop` is set (SIGINT/SIGTERM set it when it is None)."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(dep.model)
    cfg = ModelConfig.from_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    router = Router(router_config(dep))
    launcher = Launcher(dep, router)
    stop = stop or _signal_event()
    runner: web.AppRunner | None = None
    try:
        await launcher.start()
        max_len = min(int(w.info["max_model_len"]) for w in router.workers.values())
        state = ApiState(
            router, tokenizer, [dep.model], max_len, cfg.vocab_size, dep.router.api_keys
        )
        runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, dep.router.host, dep.router.port)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        url = f"http://{dep.router.host}:{port}"
        if on_ready is not None:
            result = on_ready(url, launcher, router)
            if result is not None:
                await result
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await launcher.stop()
        await router.close()


def _signal_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, event.set)
    return event


def _banner(url: str, launcher: Launcher, router: Router) -> None:
    model = launcher.dep.model
    roles = ", ".join(f"{w.id} (pid {launcher.pids()[w.id]})" for w in router.workers.values())
    print(
        f"hetero-pd is serving {model} at {url}/v1  [workers: {roles}]\n"
        f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": '
        f'[{{"role": "user", "content": "Name three colors."}}], "max_tokens": 32}}\'\n'
        "Ctrl-C stops it.",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd serve", description=__doc__)
    p.add_argument("config", help="deployment YAML (e.g. configs/local.yaml)")
    p.add_argument("--host", help="override router.host")
    p.add_argument("--port", type=int, help="override router.port (0: any free port)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dep = load_deployment(args.config)
    router = dep.router
    if args.host is not None:
        router = replace(router, host=args.host)
    if args.port is not None:
        router = replace(router, port=args.port)
    asyncio.run(serve(replace(dep, router=router), on_ready=_banner))
    return 0


if __name__ == "__main__":
    sys.exit(main())
