"""`hetero-pd status [CONFIG | --url URL]`: the running deployment's workers, from /health.

worker     role     device  health   pid    restarts  waiting  running  kv
prefill-0  prefill  cpu     up       4242   0         0        1        3.1%
decode-0   decode   cpu     down     -      2         -        -        -
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

COLUMNS = ("worker", "role", "device", "health", "pid", "restarts", "waiting", "running", "kv")


def fetch_health(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of `url`/health; a 503 still has the worker table."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def format_status(body: dict[str, Any]) -> str:
    """The worker table of a /health body."""
    rows = [COLUMNS]
    for worker_id, w in sorted(body.get("workers", {}).items()):
        load = w.get("load", {})
        state = w.get("state", "")
        if w.get("alive"):
            health = "draining" if load.get("draining") else "up"
        else:
            health = state if state and state != "running" else "down"
        up = bool(w.get("alive"))
        kv = load.get("kv_usage")
        rows.append(
            (
                worker_id,
                str(w.get("role", "?")),
                str(w.get("device", "?")),
                health,
                str(w.get("pid", "-")),
                str(w.get("restarts", 0)),
                str(load.get("waiting", "-")) if up else "-",
                str(load.get("running", "-")) if up else "-",
                f"{100 * float(kv):.1f}%" if up and kv is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([f"status: {body.get('status', '?')}", *lines])


def main(argv: list[str] | None = None) -> int:
    """`hetero-pd status`: ask the running router's /health; exit 0 when it can serve."""
    p = argparse.ArgumentParser(prog="hetero-pd status", description=main.__doc__)
    p.add_argument("config", nargs="?", help="deployment YAML (its router host and port)")
    p.add_argument("--url", help="the router's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--json", action="store_true", help="print /health's JSON as it is")
    args = p.parse_args(argv)
    from hetero_pd.deploy.operate import router_url

    url = router_url(args.config, args.url, p)
    try:
        code, body = fetch_health(url)
    except (OSError, ValueError) as e:
        print(f"hetero-pd status: no router answers at {url} ({e})", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2) if args.json else format_status(body))
    return 0 if code == 200 else 1
