"""The `hetero-pd` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from hetero_pd import __version__
from hetero_pd.models.fetch import DEFAULT_MODEL, KNOWN_MODELS

VERSION = f"hetero-pd {__version__}"


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from hetero_pd.models.fetch import fetch_model

    print(fetch_model(args.name))
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from backends import devices_report

    print(devices_report(quick=not args.full))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from hetero_pd import LLM, SamplingParams
    from hetero_pd.models.fetch import resolve_model
    from hetero_pd.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(args.model)))
    prompts = [_prompt_ids(tokenizer, p, args.chat, args.model) for p in args.prompt]
    # A KV cache for the longest prompt and its output, not the default budget (1 GiB
    # zero-filled: seconds on a busy CPU for a one-line answer).
    blocks = kv_blocks_for([len(p) for p in prompts], args.max_tokens)
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=blocks,
        num_threads=args.threads,
    )
    print(llm.engine.describe(), file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    for ids in prompts:
        print(llm.generate(ids, params)[0].outputs[0].text)
    return 0


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool, model: str) -> list[int]:
    from hetero_pd.llm import chat_prompt_ids

    if chat:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}], model)
    return list(tokenizer.encode(prompt))


def kv_blocks_for(prompt_lens: list[int], max_tokens: int, block_size: int = 16) -> int:
    """KV blocks one request at a time needs: the longest prompt plus its output."""
    longest = max(prompt_lens, default=1) + max_tokens
    return -(-longest // block_size) + 1


def _passthrough(command: str, argv: list[str]) -> int:
    """Commands with their own argument parsers (and their own --help)."""
    run: Callable[[list[str]], int]
    if command == "serve":
        from hetero_pd.deploy.serve import main as run
    elif command == "validate":
        from hetero_pd.deploy.cli import validate_main as run
    elif command == "plan":
        from hetero_pd.deploy.cli import plan_main as run
    elif command == "render":
        from hetero_pd.deploy.cli import render_main as run
    elif command == "status":
        from hetero_pd.deploy.status import main as run
    elif command == "drain":
        from hetero_pd.deploy.operate import drain_main as run
    elif command == "restart":
        from hetero_pd.deploy.operate import restart_main as run
    elif command == "worker":
        from hetero_pd.serving.worker.main import main as run
    elif command == "drill":
        from hetero_pd.deploy.drill_run import main as run
    elif command == "edge":
        from edge.cli import main as run  # the CLI fronts the whole product, edge/ included
    elif argv[:1] == ["offline"]:
        from hetero_pd.bench.offline import main as run
    elif argv[:1] == ["serve"]:
        from hetero_pd.bench.serve import main as run
    elif argv[:1] == ["pd"]:
        from hetero_pd.bench.pd import main as run
    elif argv[:1] == ["transfer"]:
        from hetero_pd.bench.transfer import main as run
    elif argv[:2] == ["kv", "wire"]:
        from hetero_pd.bench.kv_wire import main as run

        argv = argv[1:]
    elif argv[:1] == ["kv"]:
        from hetero_pd.bench.kv import main as run
    elif argv[:1] == ["routing"]:
        from hetero_pd.bench.routing import main as run
    elif argv[:1] == ["tp"]:
        from hetero_pd.bench.tp import main as run
    elif argv[:1] == ["moe"]:
        from hetero_pd.bench.moe import main as run
    elif argv[:1] == ["grammar"]:
        from hetero_pd.bench.grammar import main as run
    elif argv[:1] == ["edge-privacy"]:
        from hetero_pd.bench.edge_privacy import main as run
    elif argv[:1] == ["edge"]:
        # hetero_pd reaches into edge/ only here and in bench.edge: the product's front.
        from hetero_pd.bench.edge import main as run
    elif argv[:1] == ["per-token"]:
        from hetero_pd.bench.per_token import main as run
    elif argv[:1] == ["decode-step"]:
        from hetero_pd.bench.decode_step import main as run
    elif argv[:1] == ["profile"]:
        from hetero_pd.bench.profile import main as run
    elif argv[:1] == ["migrate"]:
        from hetero_pd.bench.migrate import main as run
    elif argv[:1] == ["spec"]:
        from hetero_pd.bench.spec import main as run
    elif argv[:1] == ["rebalance"]:
        from hetero_pd.bench.rebalance import main as run
    elif argv[:1] == ["hostile"]:
        from hetero_pd.bench.hostile import main as run
    else:
        print(
            "usage: hetero-pd bench {offline,serve,pd,transfer,kv,routing,tp,moe,edge,edge-privacy,"
            "per-token,grammar,decode-step,profile,migrate,spec,rebalance,hostile} "
            "[--help | options]"
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return run(argv[1:] if command == "bench" else argv)


PASSTHROUGH = {
    "serve": "serve a model or a deployment (router + workers): serve MODEL | CONFIG",
    "validate": "check deployment files before anything starts: validate CONFIG",
    "plan": "P/D worker counts for a deployment's workload, with the reasoning: plan CONFIG",
    "render": "Kubernetes manifests for a deployment: render k8s CONFIG",
    "status": "workers, roles, devices, health and load of a running deployment",
    "drain": "move a worker's decoding requests to the others (live migration): drain WORKER",
    "restart": "restart workers without ending a request: restart --rolling CONFIG | WORKER",
    "worker": "run one worker process (the launcher starts these)",
    "edge": "the device side: edge generate (a session from the shell) | edge plan (pick k)",
    "bench": "benchmarks: bench offline | serve | pd | transfer | kv [wire] | routing | tp | moe "
    "| edge | edge-privacy | per-token | grammar | decode-step | profile | migrate | spec "
    "| rebalance | hostile",
    "drill": "a deployment across hosts, proven in network namespaces: drill multihost",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-pd",
        description="Prefill/decode disaggregated LLM serving on heterogeneous hardware.",
    )
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="download and convert a known model once")
    p.add_argument("name", choices=sorted(KNOWN_MODELS), help="model name")
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser("devices", help="list devices with their measured capability profile")
    p.add_argument("--full", action="store_true", help="longer, steadier probes")
    p.set_defaults(func=_cmd_devices)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompt", nargs="+", help="prompt text (one completion each)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="known name or local HF folder")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(func=_cmd_generate)

    for name, text in PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        print(VERSION)  # on every command, whichever parser it has
        return 0
    if argv and argv[0] in PASSTHROUGH:
        command, rest = argv[0], argv[1:]
        return _guarded(lambda: _passthrough(command, rest))
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return _guarded(lambda: func(args))


def _guarded(run: Callable[[], int]) -> int:
    try:
        return run()
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"hetero-pd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from hetero_pd.process_exit import exit_after

    exit_after(main)
