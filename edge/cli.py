"""`hetero-pd edge generate | plan`: the device side from the command line.

hetero-pd edge generate --url https://127.0.0.1:8443 --ca-file edge-cert.pem --split 4 "Hi"
hetero-pd edge plan --prompt-len 256 --rtt-ms 20 --mbps 50   # a link you describe
hetero-pd edge plan --link 127.0.0.1:9999                    # or one you probe
hetero-pd edge plan --max-recovery 0.1   # only k whose measured token recovery is <= 10%
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from edge.codec import CODECS
from hetero_pd.serving.api.edge_protocol import MODES

PROG = "hetero-pd edge"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run a prompt through an edge session, streaming text")
    g.add_argument("prompt")
    g.add_argument(
        "--url", required=True, help="the router's edge listener, e.g. https://127.0.0.1:8443"
    )
    g.add_argument("--ca-file", default=None, help="the certificate the router logs (edge.tls)")
    g.add_argument(
        "--plaintext", action="store_true", help="allow an http:// URL (hidden states in clear)"
    )
    g.add_argument("--split", type=int, required=True, help="split layer k")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--codec", default="float16", choices=CODECS)
    g.add_argument("--mode", default="split", choices=MODES)
    g.add_argument("--runtime", default="torch", choices=("torch", "onnx"))
    g.add_argument("--api-key", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    pl = sub.add_parser("plan", help="recommend the split layer k for a model and a link")
    pl.add_argument("--model", default="smollm2-135m-instruct")
    pl.add_argument("--prompt-len", type=int, default=128)
    pl.add_argument("--output-tokens", type=int, default=64)
    pl.add_argument("--codec", default="float16", choices=CODECS)
    pl.add_argument("--edge-slowdown", type=float, default=1.0, help="device time / this host's")
    pl.add_argument("--link", default=None, help="HOST:PORT of a link probe to measure")
    pl.add_argument("--rtt-ms", type=float, default=20.0)
    pl.add_argument("--mbps", type=float, default=50.0, help="upload bandwidth, Mbit/s")
    pl.add_argument(
        "--max-recovery",
        type=float,
        default=None,
        help="refuse split layers whose measured top-1 token recovery is above this (0..1)",
    )
    pl.add_argument("--privacy-profile", default=None, help="default: the stored one")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return asyncio.run(_generate(args))
    return _plan(args)


async def _generate(args: argparse.Namespace) -> int:
    from edge.client import EdgeClient, EdgeError
    from hetero_pd.models.fetch import resolve_model

    model_dir = resolve_model(args.model)
    runtime = None
    if args.runtime == "onnx":
        from edge.onnx_runtime import OnnxEdgeRuntime

        runtime = OnnxEdgeRuntime(model_dir, args.split)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        client = EdgeClient(
            args.url,
            model_dir,
            args.split,
            model=args.model,
            codec=args.codec,
            api_key=args.api_key,
            runtime=runtime,
            mode=args.mode,
            ca_file=args.ca_file,
            plaintext=args.plaintext,
        )
        async for text in client.stream(
            prompt, max_tokens=args.max_tokens, temperature=args.temperature
        ):
            print(text, end="", flush=True)
    except EdgeError as e:
        print(file=sys.stdout)  # the text so far ends its line on stdout
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    print()  # the answer's own line ends on stdout, so `> answer.txt` holds a whole line
    print(f"[{client.sent_bytes} bytes sent by this device]", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from edge.link_probe import measure_link
    from edge.planner import LinkProfile, format_plan, plan_split
    from edge.privacy import (
        PrivacyFloorError,
        PrivacyProfile,
        PrivacyProfileError,
        apply_floor,
        default_path,
    )
    from edge.profiling import profile_layers
    from hetero_pd.models.config import ModelConfig
    from hetero_pd.models.fetch import resolve_model

    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    recovery = None
    if args.max_recovery is not None:
        path = Path(args.privacy_profile) if args.privacy_profile else default_path(args.model)
        try:
            recovery = PrivacyProfile.load(path).top1
            apply_floor(range(1, cfg.num_layers), recovery, args.max_recovery)  # fail early
        except (PrivacyProfileError, PrivacyFloorError) as e:
            print(f"{PROG} plan: {e}", file=sys.stderr)
            return 2
        print(f"privacy profile: {path}")
    if args.link:
        host, _, port = args.link.rpartition(":")
        link = measure_link(host, int(port))
    else:
        link = LinkProfile(bandwidth_bps=args.mbps * 1e6 / 8, rtt_s=args.rtt_ms / 1e3)
    lens = sorted({max(1, args.prompt_len // 2), args.prompt_len, args.prompt_len * 2})
    cloud = profile_layers(model_dir, "cpu", lens)
    edge = cloud.scaled(args.edge_slowdown)
    try:
        plan = plan_split(
            edge,
            cloud,
            link,
            prompt_len=args.prompt_len,
            hidden_size=cfg.hidden_size,
            codec=args.codec,
            objective="latency",
            output_tokens=args.output_tokens,
            recovery=recovery,
            max_recovery=args.max_recovery,
        )
    except PrivacyFloorError as e:
        print(f"{PROG} plan: {e}", file=sys.stderr)
        return 2
    print(
        f"link: RTT {link.rtt_s * 1e3:.2f} ms, {link.bandwidth_bps * 8 / 1e6:.1f} Mbit/s; "
        f"device {args.edge_slowdown:g}x this host's per-layer time (measured here)"
    )
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
