"""EdgeRuntime: tokenizer, embeddings and layers [0, k) on the device, with their KV cache.

Raw text and token ids stay here; what leaves is the hidden state after layer k-1 for each
position (see `edge.codec`). One runtime holds one sequence::

    rt = EdgeRuntime(model_dir, split_layer=4)
    h = rt.prefill(rt.tokenize("Hello"))   # [n, hidden]: send to the cloud
    h = rt.step(next_token)                # [1, hidden]: one per generated token
    rt.reset()                             # start the next prompt
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from backends import parse_device
from edge.loader import load_edge_stack, split_fingerprint
from hetero_pd.models.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EdgeRuntime:
    """Layers [0, split_layer) of the model in `model_dir`, run with torch for one sequence.

    Only the embeddings and those layers' weights are read from the folder. `prefill` starts a
    sequence, `extend`/`step` continue it; each returns the hidden states of the new positions
    (float tensors on the runtime's device, [num_new_tokens, hidden_size]), equal to the full
    model's hidden state after layer split_layer - 1 at those positions.
    """

    backend = "torch"

    def __init__(
        self,
        model_dir: str | Path,
        split_layer: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = parse_device(device)
        self.dtype = dtype
        self.stack = load_edge_stack(self.model_dir, split_layer, dtype, self.device, max_positions)
        self.cfg: ModelConfig = self.stack.cfg
        self.split_layer = split_layer
        self.max_positions = self.stack.max_positions
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._fingerprint: str | None = None
        self.reset()

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_tokens(self) -> int:
        """Positions of the current sequence already in the KV cache."""
        return int(self.past_k.shape[1])

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model folder's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (with the tokenizer's special tokens, as the engine does)."""
        return list(self.tokenizer.encode(text))

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, via the model's chat template (as the router's chat API)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def fingerprint(self) -> str:
        """`split_fingerprint` of this folder and split layer (the session-start check)."""
        if self._fingerprint is None:
            self._fingerprint = split_fingerprint(self.model_dir, self.split_layer)
        return self._fingerprint

    def reset(self) -> None:
        """Drops the current sequence and its KV cache."""
        self.past_k = self.stack.empty_cache(self.dtype, self.device)
        self.past_v = self.stack.empty_cache(self.dtype, self.device)

    def prefill(self, prompt_token_ids: Sequence[int]) -> torch.Tensor:
        """Starts a new sequence with the prompt; returns its hidden states [n, hidden]."""
        self.reset()
        return self.extend(prompt_token_ids)

    def step(self, token_id: int) -> torch.Tensor:
        """Appends one token (the one the cloud sampled); returns its hidden state [1, hidden]."""
        return self.extend([token_id])

    def extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Appends tokens to the sequence; returns their hidden states [len(token_ids), hidden].

        On a ValueError (bad ids, sequence too long) the sequence is left unchanged.
        """
        ids = self._check_ids(token_ids)
        start = self.num_tokens
        positions = torch.arange(start, start + len(ids), dtype=torch.long)
        hidden, present_k, present_v = self._forward(torch.tensor(ids, dtype=torch.long), positions)
        self.past_k, self.past_v = present_k, present_v
        return hidden

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("no token ids given: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if self.num_tokens + len(ids) > self.max_positions:
            raise ValueError(
                f"sequence would reach {self.num_tokens + len(ids)} tokens, over the edge "
                f"runtime's max_positions={self.max_positions}; reset() or raise max_positions"
            )
        return ids

    @torch.inference_mode()
    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Runs the edge layers on new tokens against the current past; returns
        (hidden, present_k, present_v). Subclasses swap the engine (ONNX Runtime)."""
        dev = self.device
        return self.stack(input_ids.to(dev), positions.to(dev), self.past_k, self.past_v)
