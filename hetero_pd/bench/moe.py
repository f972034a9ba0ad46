"""`hetero-pd bench moe`: our mixture-of-experts block against transformers' own, side by side.

For each MoE family (Mixtral, Qwen3-MoE, DeepSeek-V3) a small random model is built with
transformers (`from_config`, a fixed seed), saved, and loaded by our loader, so both sides
hold the same weights. Then one MoE layer's forward runs on the same hidden states, ours and
transformers' alternately (`--repeats` times each, so the machine's noise hits both alike),
for a decode-sized batch and a prefill-sized one. Prints one JSON line per family and batch:
the median times, their ratio (transformers / ours: above 1, ours is faster), the largest
difference between the two outputs, and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hetero_pd.bench.machine import cpu_info
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import load_model

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def hf_model(family: str, hidden: int, experts: int, inter: int) -> Any:
    """A random two-layer transformers model of `family` whose layer 1 is a MoE layer."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    if family == "mixtral":
        config: Any = tf.MixtralConfig(
            **common, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2
        )
        model_cls: Any = tf.MixtralForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **{**common, "head_dim": hidden // 8},  # not in the signature, but accepted
            intermediate_size=4 * inter,
            num_experts=experts,
            num_experts_per_tok=8 if experts >= 16 else 2,
            moe_intermediate_size=inter,
            norm_topk_prob=True,
        )
        model_cls = tf.Qwen3MoeForCausalLM
    else:
        config = tf.DeepseekV3Config(
            **common,
            intermediate_size=4 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        )
        model_cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return model_cls(config).eval()


def _times_ms(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(1000 * (time.perf_counter() - start))
    return times


def compare(family: str, tokens: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per batch size: both MoE layers' median forward time on the same input."""
    hf = hf_model(family, args.hidden, args.experts, args.inter)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        cfg = ModelConfig.from_dir(tmp)
        ours: Any = load_model(tmp, cfg, dtype, torch.device("cpu"), 256).layers[1].mlp
    theirs: Any = hf.to(dtype).model.layers[1].mlp
    rows = []
    for n in tokens:
        x = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(n)).to(dtype)
        with torch.inference_mode():
            out_ours = ours(x)
            out_theirs = theirs(x[None])
            out_theirs = out_theirs[0] if isinstance(out_theirs, tuple) else out_theirs
            ours_ms: list[float] = []
            theirs_ms: list[float] = []
            for _ in range(args.rounds):  # alternate, so drift in the machine hits both
                ours_ms += _times_ms(ours, x, args.repeats)
                theirs_ms += _times_ms(theirs, x[None], args.repeats)
        diff = (out_ours.float() - out_theirs.reshape(n, -1).float()).abs().max().item()
        ours_med, theirs_med = statistics.median(ours_ms), statistics.median(theirs_ms)
        rows.append({
            "family": family,
            "tokens": n,
            "dtype": args.dtype,
            "ours_ms": round(ours_med, 3),
            "transformers_ms": round(theirs_med, 3),
            "speedup": round(theirs_med / ours_med, 2),
            "max_abs_diff": diff,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd bench moe", description=__doc__)
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 256], help="batch sizes")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--inter", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as it is)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per side per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_info()
    for family in args.families:
        for row in compare(family, args.tokens, args):
            print(json.dumps({**row, "threads": torch.get_num_threads(), "cpu": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
