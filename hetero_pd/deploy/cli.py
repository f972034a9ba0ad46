"""Command lines of the deployment tool: `validate`, `plan` and `render k8s`.

    hetero-pd validate CONFIG [CONFIG ...] [--target local|k8s]
    hetero-pd plan CONFIG [--no-calibrate] | hetero-pd plan --measure DEVICE [--model M]
    hetero-pd render k8s CONFIG [-o FILE]

Exit status: 0 when valid, 1 when the file has issues (each printed as file:line: key:
message on stderr), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetero_pd.deploy.source import ConfigError


def validate_main(argv: list[str] | None = None) -> int:
    """`hetero-pd validate`: check deployment files before anything starts."""
    from hetero_pd.deploy.validate import TARGETS, validate_file

    p = argparse.ArgumentParser(prog="hetero-pd validate", description=validate_main.__doc__)
    p.add_argument("config", nargs="+", help="deployment YAML file(s)")
    p.add_argument(
        "--target",
        choices=TARGETS,
        default="local",
        help="local: this host runs it (devices and ports checked here); k8s: a cluster",
    )
    p.add_argument("--no-port-check", action="store_true", help="skip 'is router.port free'")
    p.add_argument(
        "--host-id",
        help="a file listing workers by host: check the part this host runs (its ports)",
    )
    args = p.parse_args(argv)
    status = 0
    for path in args.config:
        try:
            report = validate_file(path, args.target, not args.no_port_check, args.host_id)
        except ConfigError as e:
            print(e, file=sys.stderr)
            status = 1
            continue
        print(report.summary())
    return status


def plan_main(argv: list[str] | None = None) -> int:
    """`hetero-pd plan`: how many prefill and decode workers the declared workload needs."""
    from hetero_pd.deploy.plan import PlanError, host_cores, make_measure, plan_deployment
    from hetero_pd.deploy.schema import load_deployment

    p = argparse.ArgumentParser(prog="hetero-pd plan", description=plan_main.__doc__)
    p.add_argument("config", nargs="?", help="deployment YAML with a `workload:` section")
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="estimate from the capability profile instead of timing the model",
    )
    p.add_argument("--measure", metavar="DEVICE", help="only calibrate DEVICE; print capacity")
    p.add_argument("--model", default=None, help="model for --measure (default: the config's)")
    args = p.parse_args(argv)
    if args.measure:
        return _measure(args.measure, args.model, args.config)
    if args.config is None:
        p.error("give CONFIG (or --measure DEVICE)")
    try:
        dep = load_deployment(args.config)
        plan = plan_deployment(dep, make_measure(dep, not args.no_calibrate), host_cores())
    except (ConfigError, PlanError) as e:
        print(e, file=sys.stderr)
        return 1
    print(plan.explain())
    if not dep.automatic:
        have = {r: sum(w.count for w in dep.workers if w.role == r) for r in ("prefill", "decode")}
        ranks = sum(w.count * w.tensor_parallel_size for w in dep.workers)
        many = ranks > sum(w.count for w in dep.workers)
        taking = f", taking {ranks} devices (tensor-parallel ranks)" if many else ""
        print(
            f"the file itself lists {have['prefill']} prefill + {have['decode']} decode "
            f"workers{taking}"
        )
    return 0


def _measure(device: str, model: str | None, config: str | None) -> int:
    from hetero_pd.deploy.calibrate import calibrate
    from hetero_pd.deploy.schema import load_deployment
    from hetero_pd.models.fetch import DEFAULT_MODEL

    dtype = "float32"
    if config is not None:
        dep = load_deployment(config)
        model, dtype = model or dep.model, dep.dtype
    speed = calibrate(model or DEFAULT_MODEL, device, dtype)
    kind = device.split(":")[0]
    print(f"# {speed.source}")
    for note in speed.notes:
        print(f"# warning: {note}")
    print(f"pd:\n  capacity:\n    {kind}:")
    print(f"      prefill_tokens_per_s: {speed.prefill_tokens_per_s:.1f}")
    print(f"      decode_step_ms: {speed.decode_step_ms:.3f}")
    print(f"      decode_ms_per_seq: {speed.decode_ms_per_seq:.4f}")
    return 0


def render_main(argv: list[str] | None = None) -> int:
    """`hetero-pd render k8s CONFIG`: Kubernetes manifests for a deployment."""
    from hetero_pd.deploy import k8s, k8s_secrets
    from hetero_pd.deploy.plan import PlanError, resolve
    from hetero_pd.deploy.validate import validate_file

    p = argparse.ArgumentParser(prog="hetero-pd render", description=render_main.__doc__)
    p.add_argument("what", choices=["k8s"], help="what to render")
    p.add_argument("config", help="deployment YAML")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    args = p.parse_args(argv)
    try:
        report = validate_file(args.config, "k8s")
        dep, plan = resolve(report.deployment, use_calibration=False, local=False)
        values = k8s_secrets.secret_values(dep)
        text = k8s.dump(k8s.render(dep, values))
    except (ConfigError, PlanError) as e:
        print(e, file=sys.stderr)
        return 1
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if plan is not None:
        print(plan.explain(), file=sys.stderr)
    if values.generated and not dep.kubernetes.existing_secret:
        print(
            f"note: generated a new deployment secret into {k8s_secrets.secret_name(dep)}; "
            f"export {k8s_secrets.SECRET_ENV} before rendering again to keep it (a new one "
            "rolls every pod), or manage the Secret yourself (kubernetes.existing_secret)",
            file=sys.stderr,
        )
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero_pd.deploy {validate,plan,render} ...`."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"validate": validate_main, "plan": plan_main, "render": render_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m hetero_pd.deploy {validate,plan,render} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
