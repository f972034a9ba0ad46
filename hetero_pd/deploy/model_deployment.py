"""`hetero-pd serve MODEL`: a deployment built in memory from a model and vLLM's flag names.

What `serve` is given decides what it runs:

    configs/local.yaml          a deployment file (the YAML schema, every section)
    ./Qwen2.5-0.5B-Instruct     a model folder (config.json + *.safetensors + tokenizer)
    smollm2-135m-instruct       a known model name (fetched and converted once)
    Qwen/Qwen2.5-0.5B-Instruct  a Hugging Face repo id (local cache first, then the hub)

A model gets one prefill and one decode worker (`--pd P:D` for others, `--colocated` for
workers that do both) on `--device`, behind the router on `--host`/`--port`. The flags that
mean the same as vLLM's have vLLM's names; `deployment_for_model` turns them into the same
`Deployment` a YAML file would give, so both paths are checked by one schema.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero_pd.config import DTYPE_CHOICES
from hetero_pd.deploy.fields import json_object
from hetero_pd.deploy.schema import Deployment, parse_deployment
from hetero_pd.deploy.sections import TOOL_CALL_PARSERS
from hetero_pd.deploy.source import ConfigError
from hetero_pd.models.fetch import KNOWN_MODELS, ModelNotFoundError, check_model_dir

#: flag -> key of the deployment it sets (engine options keep the engine's names).
ENGINE_FLAGS = {
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "enable_prefix_caching": "--enable-prefix-caching",
    "seed": "--seed",
    "kv_cache_gb": "--kv-cache-gb",
}
#: Router keys set by flags of the same name (vLLM's tool calling).
TOOLS = ("tool_call_parser", "enable_auto_tool_choice")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True, slots=True)
class PDRatio:
    """`--pd P:D`: P prefill workers and D decode workers."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> PDRatio:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
        if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a P:D ratio; write prefill:decode worker counts, e.g. 1:1 "
                "or 2:1 (each at least 1; --colocated for workers that do both)"
            )
        return cls(int(m.group(1)), int(m.group(2)))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `serve MODEL` (vLLM's names where they mean the same thing)."""
    g = p.add_argument_group("serving a model (vLLM's flag names)")
    g.add_argument(
        "--pd",
        type=PDRatio.parse,
        default=None,
        metavar="P:D",
        help="prefill:decode worker processes (default 1:1)",
    )
    g.add_argument("--colocated", action="store_true", help="one worker that prefills and decodes")
    g.add_argument("--device", default=None, help="cpu (default) | cuda | npu: every worker's")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients send (default: MODEL as given)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require this Bearer key; any local user can read a command line, so prefer "
        "--api-key-file or $HETERO_PD_API_KEY (comma-separated)",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require the Bearer keys in this file (comma- or line-separated)",
    )
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of shared prompt prefixes (default on)",
    )
    g.add_argument("--seed", type=int, default=None, help="engine seed (unseeded requests)")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per worker")
    g.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\': '
        "speculative decoding on the decode (or colocated) workers",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the format the model writes tool calls in (default hermes)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='serve tool_choice "auto" (default on; off: a 400, as vLLM without the flag)',
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks (processes, devices) each worker splits the model over; default 1",
    )


def model_flags_given(args: argparse.Namespace) -> list[str]:
    """The model-only flags present on the command line (they make no sense with a YAML)."""
    given = [flag for key, flag in ENGINE_FLAGS.items() if getattr(args, key) is not None]
    for key in ("pd", "device", "dtype", "tensor_parallel_size", "speculative_config", *TOOLS):
        if getattr(args, key) is not None:
            given.append(f"--{key.replace('_', '-')}")
    if args.colocated:
        given.append("--colocated")
    return given


def is_deployment_file(target: str) -> bool:
    """Whether `serve TARGET` names a deployment file (rather than a model)."""
    path = Path(target).expanduser()
    return path.is_file() or (not path.exists() and path.suffix in YAML_SUFFIXES)


def resolve_model_target(target: str) -> str:
    """What workers load for `target`: a known name as is, else a local model folder.

    Raises ModelNotFoundError with what to do when `target` is none of the forms."""
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(_not_a_model(path))
        check_model_dir(path)
        return str(path)
    if target.lower() in KNOWN_MODELS:
        return target.lower()
    if _REPO_ID.match(target):
        return str(hub_snapshot(target))
    known = ", ".join(KNOWN_MODELS)
    raise ModelNotFoundError(
        f"{target!r} is neither a deployment file, a model folder, a known model name "
        f"({known}) nor a Hugging Face repo id (org/name)"
    )


def _not_a_model(path: Path) -> str:
    yamls = sorted(p.name for p in path.glob("*.y*ml"))
    hint = (
        f"; to run a deployment pass one of its files, e.g. hetero-pd serve {path / yamls[0]}"
        if yamls
        else ""
    )
    return (
        f"{path} is a folder but not a model: it has no config.json. Pass a Hugging Face "
        f"model folder (config.json, *.safetensors, tokenizer.json), a known model name "
        f"({', '.join(KNOWN_MODELS)}) or a deployment YAML{hint}"
    )


def hub_snapshot(repo_id: str) -> Path:
    """The local folder of a Hugging Face repo: the hub cache first, then a download of the
    files serving needs (config, tokenizer, safetensors)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a Hugging Face repo id but huggingface_hub is not "
            "installed; pip install huggingface_hub, or pass a local model folder"
        ) from e
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception as cached_error:  # any miss means: try the hub
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ModelNotFoundError(
                f"cannot resolve the Hugging Face repo id {repo_id!r}: it is not in the local "
                f"hub cache ({type(cached_error).__name__}) and downloading it failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). "
                f"Download it where there is network (`hf download {repo_id}`) or pass a "
                "local model folder"
            ) from e


def deployment_for_model(target: str, args: argparse.Namespace) -> Deployment:
    """The deployment `serve MODEL` runs, built from `args` (see `add_model_arguments`)."""
    model = resolve_model_target(target)
    device = args.device or "cpu"
    if args.colocated and args.pd is not None:
        raise ValueError("give --pd P:D (disaggregated) or --colocated, not both")
    workers: list[dict[str, Any]]
    if args.colocated:
        workers = [{"role": "both", "device": device}]
    else:
        pd = args.pd or PDRatio(1, 1)
        workers = [
            {"role": "prefill", "device": device, "count": pd.prefill},
            {"role": "decode", "device": device, "count": pd.decode},
        ]
    if args.tensor_parallel_size is not None:
        for w in workers:
            w["tensor_parallel_size"] = args.tensor_parallel_size
    if args.speculative_config is not None:
        for w in workers:
            if w["role"] != "prefill":
                w["speculative_config"] = args.speculative_config
    engine = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    raw: dict[str, Any] = {
        "version": 1,
        "model": model,
        "dtype": concrete_dtype(args.dtype or "auto", model, device),
        "workers": workers,
        "engine": engine,
        "router": {
            "host": args.host or "127.0.0.1",
            "port": 8000 if args.port is None else args.port,
            **{k: getattr(args, k) for k in TOOLS if getattr(args, k) is not None},
        },
    }
    try:
        return parse_deployment(raw, source="hetero-pd serve")
    except ConfigError as e:
        raise ValueError("\n".join(_flag_message(i.key, i.message) for i in e.issues)) from e


def concrete_dtype(dtype: str, model: str, device: str) -> str:
    """`--dtype auto` -> what an engine on `device` picks for this checkpoint (a deployment
    names one dtype for all its workers; hetero_pd.config owns the choice)."""
    from hetero_pd.config import resolve_dtype
    from hetero_pd.models.config import ModelConfig
    from hetero_pd.models.fetch import resolve_model

    saved = ModelConfig.from_dir(resolve_model(model)).checkpoint_dtype if dtype == "auto" else None
    return resolve_dtype(dtype, device, saved).name


def _flag_message(key: str, message: str) -> str:
    name = key.removeprefix("engine.")
    flag = ENGINE_FLAGS.get(name) or {"router.port": "--port", "router.host": "--host"}.get(key)
    if flag is None and key.startswith("workers"):
        flag = "--device" if key.endswith("device") else "--pd"
        if key.endswith("tensor_parallel_size"):
            flag = "--tensor-parallel-size"
        if key.endswith("speculative_config"):
            flag = "--speculative-config"
    return f"{flag or key}: {message}"
