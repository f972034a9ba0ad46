"""`hetero-pd drain` and `hetero-pd restart`: operate a running deployment without ending a
request, through its router's admin API (hetero_pd/serving/api/admin.py).

    hetero-pd drain CONFIG decode-0            move decode-0's requests off, keep it out
    hetero-pd drain --url URL decode-0 --undo  back in rotation
    hetero-pd drain CONFIG decode-1 --remove   scale-down: it leaves for good once drained
    hetero-pd restart --rolling CONFIG         every worker in turn: drain, stop, start
    hetero-pd restart --url URL decode-1       one worker

The key comes from HETERO_PD_ADMIN_KEY (router.admin_keys); a client's API key does not
operate a deployment that has API keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from hetero_pd import envs


def router_url(config: str | None, url: str | None, p: argparse.ArgumentParser) -> str:
    """The router's base URL: `url`, else the deployment file's router host and port."""
    if url is not None:
        return url.rstrip("/")
    if config is None:
        p.error("give CONFIG or --url")
    from hetero_pd.deploy.schema import load_deployment

    r = load_deployment(config).router
    host = "127.0.0.1" if r.host in ("0.0.0.0", "") else r.host
    return f"http://{host}:{r.port}"


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    keys = envs.admin_keys()
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _run(path: str, body: dict[str, Any], url: str, timeout_s: float, prog: str) -> int:
    try:
        code, answer = post(f"{url}{path}", {**body, "timeout_s": timeout_s}, timeout_s + 30)
    except (OSError, ValueError) as e:
        print(f"{prog}: no router answers at {url} ({e})", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0 if code == 200 else 1


def _parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--url", help="the router's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    return p


def drain_main(argv: list[str] | None = None) -> int:
    """Move every request decoding on WORKER to the other decode workers (live migration)
    and keep new requests off it (until --undo)."""
    p = _parser("hetero-pd drain", drain_main.__doc__ or "")
    p.add_argument("target", nargs="+", metavar="[CONFIG] WORKER")
    p.add_argument("--undo", action="store_true", help="put WORKER back in rotation")
    p.add_argument("--remove", action="store_true", help="then stop WORKER for good")
    args = p.parse_args(argv)
    *config, worker = args.target
    url = router_url(config[0] if config else None, args.url, p)
    path = "/admin/undrain" if args.undo else "/admin/remove" if args.remove else "/admin/drain"
    return _run(path, {"worker": worker}, url, args.timeout, "hetero-pd drain")


def restart_main(argv: list[str] | None = None) -> int:
    """Restart WORKER, or with --rolling every worker in turn, without ending a request:
    each is drained (its decoding requests migrate), stopped and started afresh."""
    p = _parser("hetero-pd restart", restart_main.__doc__ or "")
    p.add_argument("target", nargs="*", metavar="[CONFIG] [WORKER]")
    p.add_argument("--rolling", action="store_true", help="every worker, one at a time")
    args = p.parse_args(argv)
    target = list(args.target)
    worker = None if args.rolling or not target else target.pop()
    if args.rolling == (worker is not None):
        p.error("give WORKER or --rolling")
    config = target[0] if target else None
    url = router_url(config, args.url, p)
    body: dict[str, Any] = {"rolling": True} if worker is None else {"worker": worker}
    return _run("/admin/restart", body, url, args.timeout, "hetero-pd restart")
