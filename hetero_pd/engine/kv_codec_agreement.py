"""Does a lossy KV wire codec keep the model's answers? Teacher-forced top-1 agreement.

Each text is cut in two: the prompt (first half) is prefilled once, as a prefill worker
would; its KV blocks then reach the "decode side" twice, raw and through the codec
(:mod:`transfer.kv_codec`, the bytes the wire carries); the rest of the text is fed
teacher-forced on top of each, as decode steps would (new tokens' KV computed in the
engine's dtype, attending to the received prompt KV). The agreement is the share of
continuation positions whose top-1 next token is the same with both KVs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetero_pd.config import parse_dtype
from hetero_pd.engine.agreement import DEFAULT_TEXTS, Agreement
from hetero_pd.engine.kv_cache_manager import cdiv
from hetero_pd.engine.model_runner import allocate_kv_tensors, layer_caches
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.llama import CausalLM
from hetero_pd.models.loader import load_model
from hetero_pd.models.tokenizer import load_tokenizer
from transfer import kv_codec, layout


def kv_codec_agreement(
    model: str,
    codec: str = "int8",
    dtype: str = "float32",
    texts: Sequence[str] = DEFAULT_TEXTS,
    block_size: int = 16,
    device: str = "cpu",
) -> Agreement:
    """Top-1 agreement of decoding on `codec`-carried prompt KV with decoding on raw KV."""
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    sequences = [list(tokenizer.encode(t)) for t in texts]
    return token_agreement(str(path), sequences, codec, dtype, block_size, device)


@torch.inference_mode()
def token_agreement(
    path: str,
    sequences: Sequence[Sequence[int]],
    codec: str = "int8",
    dtype: str = "float32",
    block_size: int = 16,
    device: str = "cpu",
) -> Agreement:
    """:func:`kv_codec_agreement` on token id sequences (each at least 2 tokens)."""
    cfg = ModelConfig.from_dir(path)
    dt, dev = parse_dtype(dtype), torch.device(device)
    longest = max(len(s) for s in sequences)
    net: CausalLM = load_model(path, cfg, dt, dev, longest)
    shape = cfg.kv_block_shape(block_size)
    capacity = cdiv(longest, block_size)
    kv = allocate_kv_tensors(cfg.num_layers, capacity, shape, dt, dev, cfg.kv_tensors_per_layer)
    matches = positions = 0
    for seq in sequences:
        ids = torch.tensor(seq, device=dev)
        n, p = len(seq), len(seq) // 2
        for t in kv:
            t.zero_()
        _forward(net, kv, ids, 0, p)  # the prompt, as prefill computes it
        blocks = cdiv(p, block_size)
        prompt_kv = [t[:blocks].clone() for t in kv]
        raw = _continue(net, kv, ids, p)
        for t, sent in zip(kv, prompt_kv, strict=True):
            wire = layout.as_bytes(kv_codec.to_wire(codec, sent))
            t[:blocks] = kv_codec.from_wire(codec, wire, blocks, shape, dt, dt).to(dev)
        coded = _continue(net, kv, ids, p)
        matches += int((raw == coded).sum())
        positions += n - p
    return Agreement(f"{dtype} + {codec} KV", f"{dtype} KV", positions, matches)


def _forward(
    net: CausalLM, kv: list[torch.Tensor], ids: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Top-1 next tokens of ``ids[start:end]``, attending to cache slots ``[0, end)``."""
    dev = ids.device
    pos = torch.arange(start, end, device=dev)
    span = PrefillSpan(0, end - start)
    if start:
        span.context_slots = torch.arange(end, device=dev)
        span.mask = torch.arange(end, device=dev)[None, :] <= pos[:, None]
    meta = AttentionMetadata(slot_mapping=pos, prefills=[span])
    hidden = net(pos, meta, layer_caches(net.cfg, kv), input_ids=ids[start:end])
    return net.compute_logits(hidden).argmax(-1).cpu()


def _continue(net: CausalLM, kv: list[torch.Tensor], ids: torch.Tensor, p: int) -> torch.Tensor:
    """Teacher-forced top-1 tokens of positions ``[p, n)`` on the prompt KV in the cache."""
    return _forward(net, kv, ids, p, ids.numel())
