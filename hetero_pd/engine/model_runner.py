"""Turns a SchedulerOutput into one forward pass and sampled tokens. The only engine file
that touches tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetero_pd.engine.logprobs import record_prompt_logprobs, wants_prompt_logprobs
from hetero_pd.engine.sampler import Sampler
from hetero_pd.engine.scheduler import ScheduledChunk, SchedulerOutput
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM, KVCache

# (num_layers, num_blocks, block_shape, dtype, device) -> [K0, V0, K1, V1, ...]
KVAllocator = Callable[[int, int, tuple[int, ...], torch.dtype, torch.device], list[torch.Tensor]]


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    shape = (num_blocks, *block_shape)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the last token of each chunk that samples
    sample_chunks: list[int]  # index into SchedulerOutput.chunks of those chunks


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_allocator: KVAllocator | None = None,
        start_layer: int = 0,
    ) -> None:
        self.model, self.cfg = model, cfg
        # > 0: a split (edge) engine; every request's inputs are hidden states entering here.
        self.start_layer = start_layer
        self.block_size, self.device = block_size, device
        block_shape = (block_size, cfg.num_kv_heads, cfg.head_dim)
        allocate = kv_allocator or allocate_kv_tensors
        tensors = allocate(cfg.num_layers, num_blocks, block_shape, dtype, device)
        if len(tensors) != 2 * cfg.num_layers:
            raise ValueError(
                f"KV allocator gave {len(tensors)} tensors for {cfg.num_layers} layers"
            )
        # Per layer: (K, V), each [num_blocks, block_size, kv_heads, head_dim].
        self.kv_tensors = tensors
        self.kv_caches: list[KVCache] = [
            (tensors[2 * i], tensors[2 * i + 1]) for i in range(cfg.num_layers)
        ]
        self.sampler = Sampler()

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        decode_rows: list[tuple[list[int], int]] = []  # (block table, context length)
        spans: list[tuple[int, int, int, list[int]]] = []  # (row, start, end, block table)
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        for i, chunk in enumerate(out.chunks):
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            row = len(ids)
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            if chunk.num_tokens == 1:
                decode_rows.append((req.block_ids, end))
            else:
                spans.append((row, start, end, req.block_ids))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                sample_chunks.append(i)
        # Cache slot of every position of every scheduled request, as one tensor op each.
        pos = torch.tensor(positions, dtype=torch.long)
        tables = [t for t, _ in decode_rows] + [t for *_, t in spans]
        width = max((len(t) for t in tables), default=0)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        counts = [1] * len(decode_rows) + [e - s for _, s, e, _ in spans]
        row_of_token = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        slots = table[row_of_token, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device), num_decode_tokens=len(decode_rows)
        )
        if decode_rows:
            ctx = max(n for _, n in decode_rows)
            offsets = torch.arange(ctx)
            decode_table = table[: len(decode_rows)]
            dslots = decode_table[:, offsets // bs] * bs + offsets % bs
            lens = torch.tensor([n for _, n in decode_rows])
            mask = offsets[None, :] < lens[:, None]
            meta.decode_slots = dslots.reshape(-1).to(self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)
        for j, (row, start, end, _) in enumerate(spans):
            span = PrefillSpan(row, row + end - start)
            if start > 0:
                offsets = torch.arange(end)
                bt = table[len(decode_rows) + j]
                q_pos = torch.arange(start, end)
                span.context_slots = (bt[offsets // bs] * bs + offsets % bs).to(self.device)
                span.mask = (offsets[None, :] <= q_pos[:, None]).to(self.device)
            meta.prefills.append(span)
        return StepInputs(self._tensor(ids), pos.to(self.device), meta, sample_rows, sample_chunks)

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        """Runs one step; returns the sampled token per request id that samples."""
        if not self.start_layer and any(_edge_prompt_layer(c) for c in out.chunks):
            return self._execute_edge_prompts(out, on_layer_done)
        return self._run(out, on_layer_done, self.start_layer)

    def _execute_edge_prompts(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None
    ) -> dict[str, int]:
        """A step with edge prompts (they enter at layer k with layers [0, k) of their KV
        given): one forward pass for the other chunks, one per k for those. Layer callbacks
        run once every pass is done, so a layer-wise push never sends a layer too early."""
        groups: dict[int, list[ScheduledChunk]] = {}
        for chunk in out.chunks:
            groups.setdefault(_edge_prompt_layer(chunk), []).append(chunk)
        sampled: dict[str, int] = {}
        for k, chunks in sorted(groups.items()):
            if k:
                self._write_early_kv(chunks, k)
            sampled.update(self._run(SchedulerOutput(chunks=chunks), None, k))
        if on_layer_done is not None:
            for layer in range(self.cfg.num_layers):
                on_layer_done(layer)
        return sampled

    def _write_early_kv(self, chunks: list[ScheduledChunk], k: int) -> None:
        """Stores the device's KV of layers [0, k) at the scheduled prompt positions."""
        bs = self.block_size
        for chunk in chunks:
            req = chunk.request
            assert req.early_kv is not None
            start = req.num_computed_tokens
            pos = torch.arange(start, start + chunk.num_tokens)
            table = torch.tensor(req.block_ids, dtype=torch.long)
            slots = (table[pos // bs] * bs + pos % bs).to(self.device)
            kv = req.early_kv[:, :, start : start + chunk.num_tokens]
            for layer in range(k):
                for j, cache in enumerate(self.kv_caches[layer]):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[slots] = kv[layer, j].to(self.device, cache.dtype)

    def _run(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None, start: int
    ) -> dict[str, int]:
        inputs = self.prepare(out)
        hidden_in = self._hidden_inputs(out) if start else None
        hidden = self.model(
            inputs.positions,
            inputs.meta,
            self.kv_caches,
            input_ids=None if hidden_in is not None else inputs.input_ids,
            hidden_states=hidden_in,
            start_layer=start,
            on_layer_done=on_layer_done,
        )
        if any(wants_prompt_logprobs(c.request) for c in out.chunks):
            record_prompt_logprobs(self.model.compute_logits, hidden, out.chunks)
        if not inputs.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        reqs = [out.chunks[i].request for i in inputs.sample_chunks]
        tokens = self.sampler.sample_requests(logits, reqs)
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}

    def _hidden_inputs(self, out: SchedulerOutput) -> torch.Tensor:
        """The received hidden states of every scheduled position, in batch order."""
        pieces = []
        for chunk in out.chunks:
            req = chunk.request
            assert req.prompt_hidden is not None, "a split engine only takes split requests"
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            n_prompt = len(req.prompt_hidden)
            if start < n_prompt:
                pieces.append(req.prompt_hidden[start : min(end, n_prompt)])
            pieces.extend(req.hidden_rows[max(start, n_prompt) - n_prompt : end - n_prompt])
        dtype = self.kv_caches[0][0].dtype
        return torch.cat(pieces).to(self.device, dtype)


def _edge_prompt_layer(chunk: ScheduledChunk) -> int:
    """k for a chunk of an edge prompt (the layer it enters at), else 0."""
    req = chunk.request
    if req.early_kv is None or req.num_computed_tokens >= req.num_prompt_tokens:
        return 0
    return int(req.early_kv.shape[0])
