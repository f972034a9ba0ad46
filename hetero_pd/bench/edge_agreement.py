"""What a change to the rows a split sends (a codec, noise) costs the cloud's output:
teacher-forced greedy agreement with the unsplit model, on the engine's own full model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import KVCache
from hetero_pd.models.loader import load_model


class CloudReference:
    """The whole model on some prompts: the rows each split k in `splits` sends, and the
    greedy next token at every position unsplit."""

    @torch.inference_mode()
    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        prompts: Sequence[Sequence[int]],
        splits: Sequence[int],
    ) -> None:
        longest = max(len(p) for p in prompts)
        self.model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), longest + 1)
        shape = (longest, 1, cfg.num_kv_heads, cfg.head_dim)
        self.caches: list[KVCache] = [
            (torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)
        ]
        self.prompts = [list(p) for p in prompts]
        self.hidden: list[dict[int, torch.Tensor]] = []
        self.picks: list[torch.Tensor] = []
        wanted = sorted({k for k in splits if k >= 1})
        for ids in self.prompts:
            pos, meta = self._meta(len(ids))
            rows: dict[int, torch.Tensor] = {}
            h, start, tokens = None, 0, torch.tensor(ids)
            for k in [*wanted, cfg.num_layers]:  # each k > start: splits are below L
                h = self.model(pos, meta, self.caches, tokens, h, start_layer=start, end_layer=k)
                rows[k], start = h, k
            self.hidden.append(rows)
            self.picks.append(self.model.compute_logits(rows[cfg.num_layers]).argmax(dim=-1))

    @staticmethod
    def _meta(n: int) -> tuple[torch.Tensor, AttentionMetadata]:
        pos = torch.arange(n)
        return pos, AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, n)])

    @torch.inference_mode()
    def agreement(self, split: int, sent: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """Share of prompt positions whose greedy next token, with layers [split, L) run on
        `sent(rows)`, equals the unsplit model's."""
        same = total = 0
        for ids, rows, want in zip(self.prompts, self.hidden, self.picks, strict=True):
            pos, meta = self._meta(len(ids))
            out = self.model(
                pos, meta, self.caches, hidden_states=sent(rows[split]), start_layer=split
            )
            same += int((self.model.compute_logits(out).argmax(dim=-1) == want).sum())
            total += len(ids)
        return same / total
