"""Turns a SchedulerOutput into one forward pass and sampled tokens. The only engine file
that touches tensors."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from backends import Backend, backend_for, native, paged_decode
from backends.compiler import use_cache_dir
from hetero_pd import envs
from hetero_pd.engine.logprobs import record_prompt_logprobs, wants_prompt_logprobs
from hetero_pd.engine.sampler import Sampler
from hetero_pd.engine.scheduler import ScheduledChunk, SchedulerOutput
from hetero_pd.engine.spec.verify import sample_runs
from hetero_pd.engine.tp.group import RankGroup
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM, KVCache
from transfer.kv_layouts import ND, write_slots
from transfer.kv_layouts import check as check_layout

log = logging.getLogger("hetero_pd.engine")
# (num_layers, num_blocks, block_shape, dtype, device, tensors_per_layer) -> the layers'
# tensors in order ([K0, V0, K1, V1, ...], or MLA's [L0, L1, ...])
KVAllocator = Callable[
    [int, int, tuple[int, ...], torch.dtype, torch.device, int], list[torch.Tensor]
]


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    tensors_per_layer: int = 2,
) -> list[torch.Tensor]:
    """Zero-filled KV tensors from the device's backend (on the host: resident as written)."""
    shape = (num_blocks, *block_shape)
    count = tensors_per_layer * num_layers
    backend = backend_for(device)
    return [backend.zeros(shape, dtype, device) for _ in range(count)]


def layer_caches(cfg: ModelConfig, tensors: list[torch.Tensor]) -> list[KVCache]:
    """The KV tensors grouped by layer: (K, V) each, or MLA's (latent,)."""
    per = cfg.kv_tensors_per_layer
    return [tuple(tensors[per * i : per * (i + 1)]) for i in range(len(tensors) // per)]


def compiled_code_dir(kind: str) -> Path:
    """Where compiled code of `kind` ("kernels", "inductor") lives, the folder named private
    by $HETERO_PD_PRIVATE_DIR (a pod's own /tmp) trusted as such (`native.trust_private_root`)."""
    private = envs.private_dir()
    if private is not None:
        native.trust_private_root(private)
    return envs.compile_cache_dir() / kind


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # row of the last token of each chunk that samples (of every token of a chunk that
    # verifies proposals)
    sample_rows: list[int]
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
        compile: bool | None = False,
        compile_required: bool = False,
        kv_layout: str = ND,
        ranks: RankGroup | None = None,
    ) -> None:
        """cfg: the shapes of `model` (one rank's under tensor parallelism). `ranks`: on
        rank 0 of a tensor-parallel engine, the other ranks, told each step's inputs."""
        self.model, self.cfg, self.ranks = model, cfg, ranks
        #: Byte order inside KV blocks (transfer.kv_layouts): the device's, or configured.
        self.kv_layout = kv_layout
        # > 0: a split (edge) engine; every request's inputs are hidden states entering here.
        self.start_layer = start_layer
        self.block_size, self.device = block_size, device
        backend = backend_for(device)
        # Past the pool's last block, never handed out (nor reserved, moved or sent):
        #   | pool: 0 .. num_blocks-1 | null | scratch (padding only) |
        # The null block stays zero: a decode row's masked positions read its first slot, not
        # slots the row does not own (attention weighs masked V by 0, and 0 x inf is NaN).
        # Graph replay needs static shapes: padded rows write their K/V to the scratch block.
        self.padding = backend.step_padding() if compile is not False else None
        self.null_slot = num_blocks * block_size
        self.scratch_block = num_blocks + 1 if self.padding else None
        block_shape = cfg.kv_block_shape(block_size)
        why = check_layout(kv_layout, block_shape, dtype)
        if why is not None:
            raise ValueError(f"kv_layout: {why}")
        allocate = kv_allocator or allocate_kv_tensors
        total_blocks = num_blocks + (2 if self.padding else 1)
        per_layer = cfg.kv_tensors_per_layer
        tensors = allocate(cfg.num_layers, total_blocks, block_shape, dtype, device, per_layer)
        if len(tensors) != per_layer * cfg.num_layers:
            raise ValueError(
                f"KV allocator gave {len(tensors)} tensors for {cfg.num_layers} layers"
            )
        for t in tensors:
            t[num_blocks].zero_()  # the null block, whatever the allocator gave
        # Per layer: (K, V), each [num_blocks, block_size, kv_heads, head_dim], or MLA's
        # (latent,) [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim].
        self.kv_tensors = tensors
        self.kv_caches: list[KVCache] = layer_caches(cfg, tensors)
        self.sampler = Sampler()
        #: Decode attention by the backend's kernel (it reads the nd layout and K/V heads
        #: only; MLA decodes over its latents, mla.py).
        kernel = (
            all(t.is_contiguous() for t in tensors)  # not a TP rank's slice of heads
            and cfg.mla is None
            and envs.native_attention()
            and backend.native_decode_attention(dtype, compiled_code_dir("kernels"))
        )
        self.native_decode = kernel and kv_layout == ND
        #: Causal prefill chunks by the kernel too, where its AVX-512 loops run (attention.py
        #: `native_prefill`): whatever the cache's layout, since prefill attends to the
        #: chunk's own K/V, so that a worker in the NPU's layout rounds as an nd one does.
        self.native_prefill = kernel and paged_decode.bf16_path() == "avx512_bf16"
        if compile is None:  # `compile: auto`: the backend's default for this step
            compile = backend.compile_by_default(self.native_decode)
        self.compiled = compile
        self.compiled_steps = 0  # steps that ran through the compiled graph
        if compile:
            try:
                self._compile(backend)
            except Exception as e:  # no C++ compiler, an op the compiler lacks, ...
                if compile_required:
                    raise RuntimeError(f"compiling the decode step failed: {e}") from e
                log.warning("engine: compiling the decode step failed (%s); running eager", e)
                self.compiled = False
                self.model.compiled_layer = self.model.compiled_logits = None

    def _compile(self, backend: Backend) -> None:
        """Compiles the decode step now, on a fake batch, so no request waits for it."""
        use_cache_dir(compiled_code_dir("inductor"))
        if self.padding:
            for t in self.kv_tensors:
                torch._dynamo.mark_static_address(t)  # graphs write the cache in place
        self.model.compile_decode(backend.compile_step, dynamic_batch=self.padding is None)
        log.info(
            "engine: compiling the decode step for %s (a minute or more the first time, "
            "cached under %s)",
            backend.kind,
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )
        start = time.perf_counter()
        self._warm_up()
        log.info("engine: decode step compiled in %.1f s", time.perf_counter() - start)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Runs the compiled step on two fake rows with three cached tokens each (sizes that
        differ, so no dimension is mistaken for another). Without a scratch block the rows
        write into block 0, harmless before any request has run."""
        block, n = self.scratch_block or 0, 2
        ctx = self.padding.context(3) if self.padding else 3
        slots = block * self.block_size + torch.arange(ctx) % self.block_size
        positions = torch.full((n,), min(ctx, self.block_size) - 1)
        meta = AttentionMetadata(
            slot_mapping=slots[positions].to(self.device),
            num_decode_tokens=n,
            decode_slots=slots.repeat(n).to(self.device),
            decode_mask=torch.ones(n, 1, 1, ctx, dtype=torch.bool, device=self.device),
            kv_layout=self.kv_layout,
            native_decode=self.native_decode,
            native_prefill=self.native_prefill,
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(positions.to(self.device), meta, self.kv_caches, ids, compiled=True)
        self.model.compute_logits(hidden, compiled=True)

    def prepare(self, out: SchedulerOutput, pad: tuple[int, int] | None = None) -> StepInputs:
        """The step's tensors. `pad` = (rows, context) pads a decode-only batch to that many
        rows, each padding row a one-token sequence in the scratch block, and every row's
        context to that many slots (masked), for a compiled graph of that static shape."""
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
            ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            if chunk.num_tokens == 1:
                decode_rows.append((req.block_ids, end))
            else:
                spans.append((row, start, end, req.block_ids))
            if chunk.samples:
                sample_rows.extend(range(len(ids) - 1 - chunk.num_spec, len(ids)))
                sample_chunks.append(i)
        ctx = max((n for _, n in decode_rows), default=0)
        if pad is not None:
            assert not spans and self.scratch_block is not None, "only decode batches pad"
            padding_rows = pad[0] - len(ids)
            ids += [0] * padding_rows
            positions += [0] * padding_rows
            decode_rows += [([self.scratch_block], 1)] * padding_rows
            ctx = pad[1]
        # Cache slot of every position of every scheduled request, as one tensor op each.
        pos = torch.tensor(positions, dtype=torch.long)
        tables = [t for t, _ in decode_rows] + [t for *_, t in spans]
        width = max([len(t) for t in tables] + [-(-ctx // bs)])
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        counts = [1] * len(decode_rows) + [e - s for _, s, e, _ in spans]
        row_of_token = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        slots = table[row_of_token, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            num_decode_tokens=len(decode_rows),
            kv_layout=self.kv_layout,
            native_decode=self.native_decode,
            native_prefill=self.native_prefill,
        )
        if decode_rows:
            offsets = torch.arange(ctx)
            decode_table = table[: len(decode_rows)]
            lens = torch.tensor([n for _, n in decode_rows])
            mask = offsets[None, :] < lens[:, None]
            # Masked: the tail of the row's last block and its padded table entries.
            dslots = decode_table[:, offsets // bs] * bs + offsets % bs
            dslots = torch.where(mask, dslots, self.null_slot)
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
    ) -> dict[str, list[int]]:
        """Runs one step; returns per request id that samples its tokens: one, or a
        verified run where the chunk carries proposals (spec/verify.py)."""
        if not self.start_layer and any(_edge_prompt_layer(c) for c in out.chunks):
            return self._execute_edge_prompts(out, on_layer_done)
        return self._run(out, on_layer_done, self.start_layer)

    def _execute_edge_prompts(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None
    ) -> dict[str, list[int]]:
        """A step with edge prompts (they enter at layer k with layers [0, k) of their KV
        given): one forward pass for the other chunks, one per k for those. Layer callbacks
        run once every pass is done, so a layer-wise push never sends a layer too early."""
        groups: dict[int, list[ScheduledChunk]] = {}
        for chunk in out.chunks:
            groups.setdefault(_edge_prompt_layer(chunk), []).append(chunk)
        sampled: dict[str, list[int]] = {}
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
                    rows = kv[layer, j].to(self.device, cache.dtype)
                    write_slots(cache, slots, rows, self.kv_layout)

    def _compiled_shape(self, out: SchedulerOutput, start: int) -> tuple[int, int] | None:
        """(rows, context) a compiled graph runs this step at, or None to run it eager:
        compiled steps are decode-only batches of token ids, of 2+ rows for dynamic shapes
        (size 1 would need its own graph) or of a bucket's size when padding."""
        rows = len(out.chunks)
        if not self.compiled or start or any(c.num_tokens != 1 for c in out.chunks):
            return None
        ctx = max(c.request.num_computed_tokens + 1 for c in out.chunks)
        if self.padding is None:
            return (rows, ctx) if rows >= 2 else None
        bucket = self.padding.batch(rows)
        return None if bucket is None else (bucket, self.padding.context(ctx))

    def _run(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None, start: int
    ) -> dict[str, list[int]]:
        shape = self._compiled_shape(out, start)
        inputs = self.prepare(out, shape if self.padding else None)
        hidden_in = self._hidden_inputs(out) if start else None
        if self.ranks is not None and hidden_in is not None:
            raise ValueError("edge prompts (hidden states) need tensor_parallel_size 1")
        # Once the other ranks have the step, any failure leaves them out of step.
        ranks = self.ranks
        in_step = contextlib.nullcontext() if ranks is None else ranks.guard("running a step")
        with in_step:
            if self.ranks is not None:
                self.ranks.send_step(inputs.input_ids, inputs.positions, inputs.meta)
            reqs = [out.chunks[i].request for i in inputs.sample_chunks]
            masks = self.sampler.start_masks(reqs)  # computed while the forward pass runs
            hidden = self.model(
                inputs.positions,
                inputs.meta,
                self.kv_caches,
                input_ids=None if hidden_in is not None else inputs.input_ids,
                hidden_states=hidden_in,
                start_layer=start,
                on_layer_done=on_layer_done,
                compiled=shape is not None,
            )
            if any(wants_prompt_logprobs(c.request) for c in out.chunks):
                record_prompt_logprobs(self._logits, hidden, out.chunks)
            if not inputs.sample_rows:
                return {}
            if shape is not None:  # every row, padding included: the graph's shape is fixed
                self.compiled_steps += 1
                logits = self.model.compute_logits(hidden, compiled=True)[inputs.sample_rows]
            else:
                logits = self._logits(hidden[inputs.sample_rows])
        chunks = [out.chunks[i] for i in inputs.sample_chunks]
        drafts = [c.request.spec_token_ids[: c.num_spec] for c in chunks]
        runs = sample_runs(self.sampler, logits, reqs, drafts, masks)
        return {r.request_id: run for r, run in zip(reqs, runs, strict=True)}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.ranks is None:
            return self.model.compute_logits(hidden)
        return self.ranks.logits(self.model.compute_logits, hidden)

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
