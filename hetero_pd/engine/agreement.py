"""Does a reduced-precision dtype keep the model's answers? Teacher-forced top-1 agreement.

Both dtypes read the same token sequences (teacher forcing: every position sees the true
prefix, so one early difference cannot snowball) and predict the next token at every
position; the agreement is the share of positions where their top-1 tokens are equal. The
engine's own model code runs both, so this measures our bfloat16 path, not transformers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetero_pd.config import parse_dtype
from hetero_pd.engine.model_runner import allocate_kv_tensors, layer_caches
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.llama import CausalLM
from hetero_pd.models.loader import load_model
from hetero_pd.models.tokenizer import load_tokenizer

# Plain prose of several kinds (narrative, technical, instructions, dialogue).
DEFAULT_TEXTS = (
    "The lighthouse keeper had not seen a ship in eleven days. Each evening he climbed the "
    "spiral stairs, trimmed the wick and wrote the weather in a narrow book: wind from the "
    "west, low cloud, a long swell that broke white on the northern rocks. On the twelfth "
    "morning a small boat appeared near the harbour mouth, rowing against the tide, and he "
    "went down to the jetty with a coil of rope over his shoulder to wait for it.",
    "A hash table stores key-value pairs in an array of buckets. To insert a key, the table "
    "computes a hash of the key and takes it modulo the number of buckets to choose a slot. "
    "When two keys land in the same slot, the table resolves the collision either by "
    "chaining, where each bucket holds a small list, or by open addressing, where it probes "
    "the following slots until it finds an empty one. When the load factor grows too high, "
    "the table allocates a larger array and moves every entry into it.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt "
    "and seven grams of dried yeast. Add three hundred and fifty millilitres of warm water "
    "and stir until no dry flour remains. Knead the dough on a floured surface for ten "
    "minutes, until it feels smooth and springs back when pressed. Leave it covered in a "
    "warm place for an hour, shape it, let it rise again and bake it for thirty minutes.",
    "Customer: Hello, I ordered a pair of walking boots last week but they have not arrived "
    "yet. Could you tell me where they are? Assistant: Of course. Could you give me your "
    "order number, please? Customer: It is four, seven, two, nine, one. Assistant: Thank "
    "you. Your parcel left our warehouse on Tuesday and the courier expects to deliver it "
    "tomorrow before noon. I will send you the tracking link by email right away.",
)


@dataclass(frozen=True, slots=True)
class Agreement:
    """Top-1 agreement of `dtype` with `reference_dtype` over `positions` predictions."""

    dtype: str
    reference_dtype: str
    positions: int
    matches: int

    @property
    def rate(self) -> float:
        """matches / positions (1.0 when nothing was compared)."""
        return self.matches / self.positions if self.positions else 1.0

    def to_dict(self) -> dict[str, object]:
        """The JSON fields a benchmark reports."""
        return {
            "dtype": self.dtype,
            "reference_dtype": self.reference_dtype,
            "positions": self.positions,
            "top1_agreement": round(self.rate, 4),
        }


def teacher_forced_agreements(
    model: str,
    dtypes: Sequence[str],
    reference_dtype: str = "float32",
    texts: Sequence[str] = DEFAULT_TEXTS,
    device: str = "cpu",
) -> list[Agreement]:
    """Top-1 next-token agreement of each of `dtypes` with `reference_dtype` on `texts`,
    teacher forced, each text one prefill through the engine's model code on `device`; the
    reference runs once for all of them."""
    path = resolve_model(model)
    cfg = ModelConfig.from_dir(path)
    tokenizer = load_tokenizer(path)
    sequences = [list(tokenizer.encode(t)) for t in texts]
    dev = torch.device(device)
    ref = _top1(path, cfg, parse_dtype(reference_dtype), dev, sequences)
    positions = sum(len(s) for s in sequences)
    out = []
    for dtype in dtypes:
        got = _top1(path, cfg, parse_dtype(dtype), dev, sequences)
        matches = sum(int((a == b).sum()) for a, b in zip(got, ref, strict=True))
        out.append(Agreement(dtype, reference_dtype, positions, matches))
    return out


@torch.inference_mode()
def _top1(
    path: object,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    sequences: list[list[int]],
) -> list[torch.Tensor]:
    """The argmax next token at every position of every sequence, one prefill each."""
    longest = max(len(s) for s in sequences)
    model: CausalLM = load_model(str(path), cfg, dtype, device, longest)
    kv = allocate_kv_tensors(
        cfg.num_layers, longest, cfg.kv_block_shape(1), dtype, device, cfg.kv_tensors_per_layer
    )
    caches = layer_caches(cfg, kv)
    out = []
    for seq in sequences:
        n = len(seq)
        positions = torch.arange(n, device=device)
        meta = AttentionMetadata(slot_mapping=positions, prefills=[PrefillSpan(0, n)])
        ids = torch.tensor(seq, device=device)
        hidden = model(positions, meta, caches, input_ids=ids)
        out.append(model.compute_logits(hidden).argmax(-1).cpu())
    return out
