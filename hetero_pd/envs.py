"""Every HETERO_PD_* environment variable, read in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: $HETERO_PD_CACHE_DIR, else ~/.cache/hetero-pd."""
    env = os.environ.get("HETERO_PD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hetero-pd"


def private_dir() -> Path | None:
    """$HETERO_PD_PRIVATE_DIR: a folder only this uid (and root) can reach, whatever its mode
    (a Kubernetes pod's emptyDir /tmp, 0777 without the sticky bit): compiled code below it is
    trusted without it passing the check of the folders above (`backends.native`)."""
    env = os.environ.get("HETERO_PD_PRIVATE_DIR")
    return Path(env) if env else None


def compile_cache_dir() -> Path:
    """Where compiled code lives (the attention kernel, inductor's cache), which a process
    loads and runs: $HETERO_PD_COMPILE_CACHE_DIR, else cache_dir(). Kubernetes pods keep it
    in their own /tmp: the model cache volume is shared, and every pod runs as one uid."""
    env = os.environ.get("HETERO_PD_COMPILE_CACHE_DIR")
    return Path(env) if env else cache_dir()


def num_threads() -> int | None:
    """$HETERO_PD_NUM_THREADS: torch intra-op threads for CPU engines (unset: torch's default)."""
    env = os.environ.get("HETERO_PD_NUM_THREADS")
    return int(env) if env else None


ADVERTISE_WAIT_S = "HETERO_PD_ADVERTISE_WAIT_S"


def advertise_wait_s() -> float:
    """$HETERO_PD_ADVERTISE_WAIT_S: how long a worker waits for the name it advertises to
    lead to the address it binds (DNS may lag behind a new pod) before it refuses to start
    (default 10). The drill's test of a wrong name sets it low: it would only wait out the
    default before failing the same way."""
    env = os.environ.get(ADVERTISE_WAIT_S, "").strip()
    if not env:
        return 10.0
    value = float(env)
    if value < 0:
        raise ValueError(f"{ADVERTISE_WAIT_S} must be >= 0, got {env!r}")
    return value


#: Names a bench sets for the engines it starts in its own process (bench/decode_step.py).
ADAPTIVE_THREADS, NATIVE_ATTENTION = "HETERO_PD_ADAPTIVE_THREADS", "HETERO_PD_NATIVE_ATTENTION"


def adaptive_threads() -> bool:
    """$HETERO_PD_ADAPTIVE_THREADS: "0" keeps a CPU engine's thread count fixed instead of
    lowering it while other processes keep its CPUs busy (backends/cpu_share.py)."""
    return os.environ.get(ADAPTIVE_THREADS, "1").strip() != "0"


def native_attention() -> bool:
    """$HETERO_PD_NATIVE_ATTENTION: "0" keeps CPU decode attention on the portable path,
    and causal prefill on SDPA, instead of the C kernel built on first use
    (backends/paged_decode.py)."""
    return os.environ.get(NATIVE_ATTENTION, "1").strip() != "0"


NATIVE_NORM = "HETERO_PD_NATIVE_NORM"


def native_norm() -> bool:
    """$HETERO_PD_NATIVE_NORM: "0" keeps CPU RMSNorm on torch's ops instead of the C kernel
    built on first use (backends/rms_norm.py)."""
    return os.environ.get(NATIVE_NORM, "1").strip() != "0"


def auto_dtype() -> str | None:
    """$HETERO_PD_AUTO_DTYPE: a dtype name that `dtype: auto` resolves to on every device,
    whatever the backend's probe would pick, so one machine reproduces another (the test
    suite runs its dtype-sensitive tests forced both ways). Unset: the backend decides."""
    env = os.environ.get("HETERO_PD_AUTO_DTYPE", "").strip().lower()
    return env or None


FORK_SERVER = "HETERO_PD_FORK_SERVER"


def fork_server() -> bool:
    """$HETERO_PD_FORK_SERVER: "1" forks the workers of a deployment that does not set
    `supervisor.fork_server` from a fork server (hetero_pd/deploy/forkserver.py; the test
    suite sets it), "0" or unset starts them as `python -m` processes."""
    env = os.environ.get(FORK_SERVER, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{FORK_SERVER} must be '0' or '1', got {env!r}")
    return env == "1"


def deployment_secret(environ: Mapping[str, str] | None = None) -> str:
    """$HETERO_PD_SECRET: the deployment secret (never on a command line); "" when unset."""
    return (os.environ if environ is None else environ).get("HETERO_PD_SECRET", "")


def worker_key() -> str:
    """$HETERO_PD_WORKER_KEY: a worker's credential (hetero_pd/secrets.py); "" when unset."""
    return os.environ.get("HETERO_PD_WORKER_KEY", "")


def api_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """$HETERO_PD_API_KEY: comma-separated API keys; () when unset."""
    return _keys("HETERO_PD_API_KEY", environ)


def priority_api_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """$HETERO_PD_PRIORITY_API_KEY: comma-separated API keys whose `priority` is honoured
    (`router.priority_api_keys`); () when unset."""
    return _keys("HETERO_PD_PRIORITY_API_KEY", environ)


def admin_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """$HETERO_PD_ADMIN_KEY: comma-separated keys for the router's /admin/* routes
    (`router.admin_keys`; `hetero-pd drain` and `restart` send the first); () when unset."""
    return _keys("HETERO_PD_ADMIN_KEY", environ)


def _keys(name: str, environ: Mapping[str, str] | None) -> tuple[str, ...]:
    raw = (os.environ if environ is None else environ).get(name, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def compile_mode() -> str | None:
    """$HETERO_PD_COMPILE: "on" or "off" overrides `compile: auto` (tests set "off")."""
    env = os.environ.get("HETERO_PD_COMPILE", "").strip().lower()
    if env and env not in ("on", "off"):
        raise ValueError(f"HETERO_PD_COMPILE must be 'on' or 'off', got {env!r}")
    return env or None


#: How an engine runs rather than what it computes: a drill hands the ones set in its own
#: environment to every pod it starts (an operator's `HETERO_PD_COMPILE=off` reaches them).
ENGINE_TUNING = (
    "HETERO_PD_COMPILE",
    "HETERO_PD_AUTO_DTYPE",
    "HETERO_PD_NUM_THREADS",
    "HETERO_PD_ADAPTIVE_THREADS",
    "HETERO_PD_NATIVE_ATTENTION",
    "HETERO_PD_NATIVE_NORM",
)


def engine_tuning() -> dict[str, str]:
    """The ENGINE_TUNING variables set in this process's environment."""
    return {name: os.environ[name] for name in ENGINE_TUNING if name in os.environ}


def tp_timeout_s() -> float:
    """$HETERO_PD_TP_TIMEOUT_S: how long a tensor-parallel rank waits in one collective (or
    at start-up for the others) before the worker gives up with an error (default 300)."""
    env = os.environ.get("HETERO_PD_TP_TIMEOUT_S", "").strip()
    if not env:
        return 300.0
    value = float(env)
    if value <= 0:
        raise ValueError(f"HETERO_PD_TP_TIMEOUT_S must be > 0, got {env!r}")
    return value
