"""Latency profiles for the split planner: every layer of a model on a device (the engine's
own forward pass, timed layer by layer), or an edge runtime as it will really run."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from backends import backend_for, parse_device
from edge.planner import SideProfile
from edge.runtime import EdgeRuntime
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import KVCache
from hetero_pd.models.loader import load_model


@torch.inference_mode()
def profile_layers(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    seq_lens: Sequence[int] = (16, 64),
    *,
    repeats: int = 3,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> SideProfile:
    """Times every layer of the model for a prefill of n tokens and one decode step after
    them, for each n in `seq_lens` (median of `repeats` after a warm-up), plus the LM head.

    `scale` multiplies every time, to emulate a slower (> 1) or faster device. Loads the
    whole model: profiling is an offline step, unlike `EdgeRuntime`.
    """
    lens = sorted(set(seq_lens))
    dev = parse_device(device)
    backend = backend_for(dev)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, dtype, dev, lens[-1] + 1)
    # One sequence, cache slot = position: [positions, 1, kv_heads, head_dim] per layer.
    shape = (lens[-1] + 1, 1, cfg.num_kv_heads, cfg.head_dim)
    caches: list[KVCache] = [
        (torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
        for _ in range(cfg.num_layers)
    ]
    ids = torch.randint(
        0, cfg.vocab_size, (lens[-1] + 1,), generator=torch.Generator().manual_seed(0)
    )

    def timed(positions: torch.Tensor, meta: AttentionMetadata) -> tuple[list[float], torch.Tensor]:
        stamps: list[float] = []

        def done(_: int) -> None:
            backend.synchronize(dev)
            stamps.append(time.perf_counter())

        backend.synchronize(dev)
        start = time.perf_counter()
        h = model(
            positions.to(dev), meta, caches, input_ids=ids[positions].to(dev), on_layer_done=done
        )
        edges = [start, *stamps]
        return [b - a for a, b in itertools.pairwise(edges)], h

    prefill_rows, decode_rows, head = [], [], []
    for n in lens:
        pre: list[list[float]] = []
        dec: list[list[float]] = []
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, device=dev), prefills=[PrefillSpan(0, n)]
            )
            times, h = timed(torch.arange(n), meta)
            pre.append(times)
            times, h = timed(torch.tensor([n]), _decode_meta(n, dev))
            dec.append(times)
            backend.synchronize(dev)
            start = time.perf_counter()
            model.compute_logits(h[-1:])
            backend.synchronize(dev)
            head.append(time.perf_counter() - start)
        prefill_rows.append(_median_rows(pre[1:]))
        decode_rows.append(_median_rows(dec[1:]))
    profile = SideProfile(
        seq_lens=tuple(lens),
        prefill_s=tuple(prefill_rows),
        decode_s=tuple(decode_rows),
        head_s=statistics.median(head),
        device=str(dev),
    )
    return profile if scale == 1.0 else profile.scaled(scale)


def _decode_meta(position: int, dev: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([position], device=dev),
        num_decode_tokens=1,
        decode_slots=torch.arange(position + 1, device=dev),
        decode_mask=torch.ones(1, 1, 1, position + 1, dtype=torch.bool, device=dev),
    )


def _median_rows(rows: list[list[float]]) -> tuple[float, ...]:
    return tuple(statistics.median(col) for col in zip(*rows, strict=True))


def profile_runtime(
    runtime: EdgeRuntime,
    num_layers: int,
    seq_lens: Sequence[int] = (16, 64),
    *,
    repeats: int = 3,
) -> SideProfile:
    """Times an edge runtime (torch or ONNX Runtime) end to end: `prefill` of n tokens and one
    `step` after them, for each n. Llama-family layers cost the same, so each of the model's
    `num_layers` layers gets 1/k of the runtime's time (k = its split layer), which lets the
    planner price every k from one measured runtime. Resets the runtime."""
    lens = sorted(set(seq_lens))
    k = runtime.split_layer
    prefill_rows, decode_rows = [], []
    for n in lens:
        ids = [(7 * i + 3) % runtime.cfg.vocab_size for i in range(n + 1)]
        pre, dec = [], []
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            start = time.perf_counter()
            runtime.prefill(ids[:n])
            pre.append(time.perf_counter() - start)
            start = time.perf_counter()
            runtime.step(ids[n])
            dec.append(time.perf_counter() - start)
        prefill_rows.append((statistics.median(pre[1:]) / k,) * num_layers)
        decode_rows.append((statistics.median(dec[1:]) / k,) * num_layers)
    runtime.reset()
    return SideProfile(
        seq_lens=tuple(lens),
        prefill_s=tuple(prefill_rows),
        decode_s=tuple(decode_rows),
        device=f"{runtime.device} ({runtime.backend})",
    )
