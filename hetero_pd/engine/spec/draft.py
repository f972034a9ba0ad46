"""The `draft_model` proposer: a smaller model with the target's tokenizer proposes k tokens
greedily, one forward pass per token, over its own paged KV cache.

Its KV lives in a pool and block tables of its own, keyed by request id, not in slots of
the target's block tables: the target's blocks are filled by transfers from prefill
workers, its prefix cache, the KV tiers and migrations, none of which carry draft KV, so
draft slots beside them would be valid for some blocks and not others. A private pool is
the proposer's alone: the draft computes a request's prompt KV itself the first time it
proposes for it (on a decode worker that is where the prompt's KV arrived without it: the
transfer wire and KV formats stay the target's, whatever hardware prefilled), and catches
up on the tokens it has not seen (at most `max_num_batched_tokens` a step) before it
proposes.

Rollback: the draft's KV at position p came from its input token at p. After a
verification, the positions whose input was a proposal the target rejected no longer
hold the sequence's tokens; the draft's computed count drops to the longest prefix whose
inputs still agree, and those positions are computed again (over the same slots) from the
tokens the target kept. The draft proposes greedily, so its proposal distribution is
one-hot and verification (spec/verify.py) keeps the target's distribution exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetero_pd.engine.loading import use_backend_kernels
from hetero_pd.engine.model_runner import ModelRunner
from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import ScheduledChunk, SchedulerOutput
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.loader import load_model
from hetero_pd.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """Raises ValueError naming both models when the draft's vocabulary or tokenizer is not
    the target's (its token ids would mean other tokens)."""
    sizes = ModelConfig.from_dir(target).vocab_size, ModelConfig.from_dir(draft).vocab_size
    why = None
    if sizes[0] != sizes[1]:
        why = f"vocab_size {sizes[1]} (target: {sizes[0]})"
    elif _vocab(target) != _vocab(draft):
        why = "a tokenizer whose vocabulary differs from the target's"
    if why is not None:
        raise ValueError(
            f"speculative_config.model {str(draft)!r} has {why}; a draft model must share "
            f"the tokenizer of the target model {str(target)!r}"
        )


def _vocab(folder: Path) -> object:
    """The token -> id map of a folder's tokenizer.json (else its tokenizer.model bytes)."""
    path = folder / "tokenizer.json"
    if path.is_file():
        return json.loads(path.read_text()).get("model", {}).get("vocab")
    model = folder / "tokenizer.model"
    return model.read_bytes() if model.is_file() else None


@dataclass(slots=True)
class _Seq:
    """The draft's view of one request: a shadow Request over the draft's own blocks."""

    req: Request
    base: int = 0  # tokens that were the target's when the draft last proposed
    blocks: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(
        self,
        model: str,
        target: Path,
        k: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_tokens_per_step: int,
    ) -> None:
        self.path = resolve_model(model)
        check_same_tokenizer(target, self.path)
        cfg = ModelConfig.from_dir(self.path)
        draft = load_model(self.path, cfg, dtype, device, max_model_len)
        use_backend_kernels(draft, device, dtype)
        self.runner = ModelRunner(draft, cfg, num_blocks, block_size, device, dtype)
        self.k, self.block_size = k, block_size
        self.max_tokens_per_step = max_tokens_per_step
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _Seq] = {}

    def release_except(self, live: set[str]) -> None:
        """Frees the draft KV of every request not in `live` (finished, preempted, moved)."""
        for rid in [r for r in self._seqs if r not in live]:
            self._free.extend(self._seqs.pop(rid).blocks)

    def propose(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to min(k, room) tokens per request (a room of 0: none), greedy from the draft."""
        out: list[list[int]] = [[] for _ in reqs]
        budget, active = self.max_tokens_per_step, []
        for i, (req, room) in enumerate(zip(reqs, rooms, strict=True)):
            k = min(self.k, room)
            seq = self._sync(req) if k > 0 else None
            if seq is None or budget <= 0 or not self._reserve(seq, req.num_tokens + k - 1):
                continue
            todo = seq.req.num_tokens - seq.req.num_computed_tokens
            n = min(todo, budget)
            budget -= n
            active.append((i, seq, k, n, n == todo))
        chunks = [ScheduledChunk(seq.req, n) for _, seq, _, n, _ in active]
        live = [(i, seq, k) for i, seq, k, _, whole in active if whole]
        while chunks:
            chunks.sort(key=lambda c: c.num_tokens > 1)  # decode rows first, as scheduled
            sampled = self.runner.execute(SchedulerOutput(chunks))
            for chunk in chunks:
                chunk.request.num_computed_tokens += chunk.num_tokens
            for i, seq, _ in live:
                token = sampled[seq.req.request_id][0]
                out[i].append(token)
                seq.req.all_token_ids.append(token)
            live = [(i, seq, k) for i, seq, k in live if len(out[i]) < k]
            chunks = [ScheduledChunk(seq.req, 1) for _, seq, _ in live]
        return out

    def _sync(self, req: Request) -> _Seq:
        """The request's draft state with its tokens set to the target's, its computed
        count cut to the positions whose inputs the target kept (the rollback)."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            shadow = Request(req.request_id, req.prompt_token_ids, _GREEDY)
            seq = self._seqs[req.request_id] = _Seq(shadow)
        mine, theirs = seq.req.all_token_ids, req.all_token_ids
        keep = min(seq.req.num_computed_tokens, len(theirs), seq.base)
        while keep < seq.req.num_computed_tokens and keep < len(theirs):
            if mine[keep] != theirs[keep]:
                break
            keep += 1
        seq.req.num_computed_tokens = keep
        seq.req.all_token_ids = list(theirs)
        seq.base = len(theirs)
        return seq

    def _reserve(self, seq: _Seq, slots: int) -> bool:
        """Blocks for `slots` token positions; False (nothing taken) when the pool lacks."""
        need = -(-slots // self.block_size) - len(seq.blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        seq.req.block_ids = seq.blocks
        return True
