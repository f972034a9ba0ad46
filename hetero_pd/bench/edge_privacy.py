"""`hetero-pd bench edge-privacy`: how much of a prompt the cloud can read back from what an
edge split sends, per split layer k, in one run on the CPU.

The attacker holds the model's weights and public text. Training text: the Python
documentation topics that ship with CPython (`pydoc_data.topics`, PSF licence), cut into
sequences; evaluation: the prompts below (personal details, plain requests), which share no
sentence with it. For each k the bench runs, on the rows a split at k sends (after the codec,
and after the noise defence when asked; see `edge.inversion` for the attacks):

    nn       each candidate token alone through layers [0, k), matched by cosine; at k = 0
             every token (the table is the embedding table), at k >= 1 the --nn-candidates
             lowest token ids (a BPE vocabulary's merge order roughly ranks frequency), up
             to --nn-max-k (the table costs a forward pass per candidate and layer)
    linear   ridge regression row -> input embedding, matched to the whole vocabulary
    mlp      (--long) the same with a two-layer MLP
    kv       prompt_only sessions also send the K/V of layers [0, k): layer 0's V rows
             matched to their exact per-token table, and layer k-1's V rows through a ridge
             map (`kv_last`)

and reports token recovery top-1/top-5, plus, for k >= 1, the cloud's teacher-forced greedy
agreement with the unsplit model on those rows (what the codec or the noise costs). The
worst top-1 over the attacks on clean rows per k is stored as the model's privacy profile,
which `hetero-pd edge plan --max-recovery` reads. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from edge.codec import decode, encode
from edge.inversion import (
    Capture,
    apply_linear,
    capture,
    fit_linear,
    fit_mlp,
    nearest,
    score,
    standardize_like,
    token_tables,
    value_table,
)
from edge.loader import load_edge_stack
from edge.noise import add_noise
from edge.privacy import PrivacyProfile, default_path
from hetero_pd.bench.edge_agreement import CloudReference
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model

PROG = "hetero-pd bench edge-privacy"
CORPUS = "CPython's pydoc_data.topics (the Python documentation topics, PSF licence)"
EVAL_PROMPTS = (
    "My name is Maria Gonzalez and I live at 42 Elm Street in Portland.",
    "Please draft a polite email to my landlord about the broken heater in my flat.",
    "I was diagnosed with type 2 diabetes last spring; what should I eat for breakfast?",
    "Summarize the quarterly sales figures: revenue rose nine percent, costs fell slightly.",
    "Translate into French: the meeting with our lawyer is moved to Thursday afternoon.",
    "My daughter Emily turns seven next week. Suggest a birthday party theme with dinosaurs.",
    "Write a short poem about the sea at night, the lighthouse and a lonely fisherman.",
    "Our startup plans to acquire a competitor in Berlin before the merger is announced.",
)
DEFAULT_SPLITS = (0, 1, 2, 4, 8, 16, 29)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--splits", default=None, help="comma-separated k (default 0,1,2,4,8,16,29)")
    p.add_argument("--train-tokens", type=int, default=2048, help="public-text positions")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--nn-candidates", type=int, default=8192, help="0: the whole vocabulary")
    p.add_argument("--nn-max-k", type=int, default=8, help="deepest k the nn attack runs at")
    p.add_argument("--codecs", default="float16,int8")
    p.add_argument("--noise", default="0.1,0.5", help="noise sigmas to try (float16), '' for none")
    p.add_argument(
        "--long",
        action="store_true",
        help="every k (unless --splits), nn on the whole vocabulary, the MLP attack",
    )
    p.add_argument("--mlp-steps", type=int, default=600, help="with --long")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile-out", default=None, help="where to store the privacy profile")
    p.add_argument("--no-store", action="store_true", help="do not store the privacy profile")
    return p.parse_args(argv)


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def training_sequences(tokenizer: Any, tokens: int, seq_len: int) -> list[list[int]]:
    """`tokens` positions of public text in sequences of `seq_len`, spread over the corpus."""
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    count = max(1, tokens // seq_len)
    stride = max(seq_len, (len(ids) - seq_len) // count)
    return [ids[i : i + seq_len] for i in range(0, stride * count, stride)][:count]


def candidates(limit: int, vocab: int) -> torch.Tensor:
    """The nearest-neighbour attack's tokens at k >= 1: the `limit` lowest ids (all if 0)."""
    return torch.arange(vocab if limit <= 0 else min(limit, vocab))


def sent(rows: torch.Tensor, codec: str, sigma: float, seed: int) -> torch.Tensor:
    """Rows as the cloud receives them: noise (if any), then the codec's round trip."""
    noisy = add_noise(rows, sigma, torch.Generator().manual_seed(seed))
    return decode(encode(noisy, codec)).float()


def attack_row(
    k: int,
    train: Capture,
    ev: Capture,
    codec: str,
    sigma: float,
    ctx: dict[str, Any],
) -> dict[str, Any]:
    """Every attack on the rows a split at k sends through (codec, sigma)."""
    embed, vocab_ids = ctx["embed"], ctx["vocab_ids"]
    x_train = sent(train.hidden[k], codec, sigma, 1)
    x_eval = sent(ev.hidden[k], codec, sigma, 2)
    row: dict[str, Any] = {"k": k, "codec": codec, "noise_sigma": sigma}
    if k == 0:
        nn = score(nearest(x_eval, embed, vocab_ids), ev.ids)
        row.update(nn_top1=nn.top1, nn_top5=nn.top5)
    elif k in ctx["tables"]:
        nn = score(nearest(x_eval, ctx["tables"][k], ctx["cands"]), ev.ids)
        row.update(nn_top1=nn.top1, nn_top5=nn.top5)
    w = fit_linear(x_train, embed[train.ids])
    lin = score(nearest(apply_linear(w, x_eval, x_train), embed, vocab_ids), ev.ids)
    row.update(linear_top1=lin.top1, linear_top5=lin.top5)
    if ctx["long"]:
        net = fit_mlp(x_train, embed[train.ids], steps=ctx["mlp_steps"])
        with torch.no_grad():
            pred = net(standardize_like(x_eval, x_train))
        mlp = score(nearest(pred, embed, vocab_ids), ev.ids)
        row.update(mlp_top1=mlp.top1, mlp_top5=mlp.top5)
    if k >= 1 and sigma == 0:
        v0 = score(nearest(sent(ev.values[0], codec, 0, 3), ctx["v0"], vocab_ids), ev.ids)
        vt, ve = sent(train.values[k - 1], codec, 0, 4), sent(ev.values[k - 1], codec, 0, 5)
        w = fit_linear(vt, embed[train.ids])
        last = score(nearest(apply_linear(w, ve, vt), embed, vocab_ids), ev.ids)
        row.update(kv_v0_top1=v0.top1, kv_v0_top5=v0.top5)
        row.update(kv_last_top1=last.top1, kv_last_top5=last.top5)
    ref = ctx["cloud"]
    row["agreement_pct"] = ref.agreement(k, lambda h: sent(h, codec, sigma, 6)) * 100 if k else None
    return row


def worst_top1(row: dict[str, Any]) -> float:
    """The strongest hidden-state attack's top-1 (the KV attacks apply to prompt_only only)."""
    return max(v for key, v in row.items() if key.endswith("_top1") and not key.startswith("kv"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    last = cfg.num_layers - 1
    if args.splits:
        ks = sorted({int(k) for k in args.splits.split(",")})
    elif args.long:
        ks = list(range(cfg.num_layers))
    else:
        ks = sorted({min(k, last) for k in DEFAULT_SPLITS})
    if not all(0 <= k <= last for k in ks):
        print(f"{PROG}: split layers must be in [0, {last}]", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_seqs = training_sequences(tokenizer, args.train_tokens, args.seq_len)
    eval_seqs = [tokenizer.encode(p, add_special_tokens=False) for p in EVAL_PROMPTS]
    text = corpus_text()
    overlap = [p for p in EVAL_PROMPTS if p in text]
    if overlap:
        raise SystemExit(f"{PROG}: evaluation prompts found in the training text: {overlap}")
    longest = max(len(s) for s in (*train_seqs, *eval_seqs))
    stack = load_edge_stack(model_dir, max(1, max(ks)), torch.float32, torch.device("cpu"), longest)
    v_layers = sorted({0} | {k - 1 for k in ks if k >= 1})
    train, ev = capture(stack, train_seqs, ks, v_layers), capture(stack, eval_seqs, ks, v_layers)
    cands = candidates(0 if args.long else args.nn_candidates, cfg.vocab_size)
    nn_ks = [k for k in ks if 1 <= k <= args.nn_max_k]
    coverage = float(torch.isin(ev.ids, cands).float().mean())
    vocab_ids = torch.arange(cfg.vocab_size)
    ctx = {
        "embed": stack.embed_tokens.weight.detach().float(),
        "vocab_ids": vocab_ids,
        "cands": cands,
        "tables": token_tables(stack, cands, nn_ks) if nn_ks else {},
        "v0": value_table(stack, vocab_ids),
        "long": args.long,
        "mlp_steps": args.mlp_steps,
        "cloud": CloudReference(model_dir, cfg, eval_seqs, ks),
    }
    prepared = time.perf_counter() - started
    codecs = [c for c in args.codecs.split(",") if c]
    sigmas = [float(s) for s in args.noise.split(",") if s]
    variants = [(c, 0.0) for c in codecs] + [(codecs[0], s) for s in sigmas if s > 0]
    print(
        f"attacker's training text: {len(train_seqs)} sequences, {len(train.ids)} positions of "
        f"{CORPUS}; evaluated on {len(eval_seqs)} prompts, {len(ev.ids)} positions; nearest "
        f"neighbour at k = 1..{max(nn_ks, default=0)} over {len(cands)} candidate tokens (they "
        f"cover {coverage * 100:.1f}% of the prompts' tokens); setup {prepared:.0f} s on "
        f"{args.threads} thread(s)",
        flush=True,
    )
    rows = []
    for k in ks:
        for codec, sigma in variants:
            row = attack_row(k, train, ev, codec, sigma, ctx)
            rows.append(row)
            print(format_row(row), flush=True)
    clean = [r for r in rows if r["noise_sigma"] == 0]
    recovery = {k: max(worst_top1(r) for r in clean if r["k"] == k) for k in ks}
    kv = {k: max(r["kv_v0_top1"], r["kv_last_top1"]) for r in clean if (k := r["k"]) >= 1}
    path = Path(args.profile_out) if args.profile_out else default_path(args.model)
    if not args.no_store:
        profile = PrivacyProfile(
            model=args.model,
            attacks="nn+linear" + ("+mlp" if args.long else ""),
            codecs=tuple(codecs),
            top1=recovery,
            kv_top1=kv,
            measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        profile.save(path)
        print(f"privacy profile stored: {path}")
    result = {
        "model": args.model,
        "splits": ks,
        "corpus": "pydoc_data.topics",
        "train_positions": len(train.ids),
        "eval_positions": len(ev.ids),
        "nn_candidates": len(cands),
        "nn_max_k": max(nn_ks, default=0),
        "nn_coverage": round(coverage, 4),
        "rows": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows
        ],
        "recovery_top1": {str(k): round(v, 4) for k, v in recovery.items()},
        "profile": None if args.no_store else str(path),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return 0


def format_row(row: dict[str, Any]) -> str:
    pct = {k: f"{v * 100:5.1f}" for k, v in row.items() if k.endswith(("_top1", "_top5"))}
    attacks = "  ".join(
        f"{name} {pct[name + '_top1']}/{pct[name + '_top5']}"
        for name in ("nn", "linear", "mlp", "kv_v0", "kv_last")
        if name + "_top1" in pct
    )
    agree = row["agreement_pct"]
    agreement = f"agreement {agree:6.2f}%" if agree is not None else "agreement   -   "
    return (
        f"k={row['k']:2d} {row['codec']:7s} sigma {row['noise_sigma']:<4g} {agreement}  "
        f"top-1/top-5 %: {attacks}"
    )


if __name__ == "__main__":
    sys.exit(main())
