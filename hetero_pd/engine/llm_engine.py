"""LLMEngine: add requests, step (schedule -> run -> update -> detokenize), abort."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from backends import backend_for, parse_device
from backends.cpu_share import HostBoard
from hetero_pd.config import EngineConfig
from hetero_pd.engine.health import EngineFault, EngineLoad, RequestFailure
from hetero_pd.engine.hidden_prompts import HiddenPrompts
from hetero_pd.engine.kv_cache_manager import KVCacheManager
from hetero_pd.engine.kv_tiers import KVTierStats, build_kv_tiers
from hetero_pd.engine.loading import load_runner, max_model_len, thread_governor
from hetero_pd.engine.logprobs import adopt_remote_logprobs
from hetero_pd.engine.model_runner import KVAllocator
from hetero_pd.engine.output_builder import OutputBuilder
from hetero_pd.engine.parallel_sampling import check_engine_params
from hetero_pd.engine.pooling import embed
from hetero_pd.engine.request import Request, RequestStatus
from hetero_pd.engine.sampler import advance_generator
from hetero_pd.engine.scheduler import Role, Scheduler, SchedulerConfig, SchedulerOutput
from hetero_pd.engine.spec.speculator import build_speculator
from hetero_pd.engine.step_costs import StepCosts
from hetero_pd.engine.structured import GrammarCompiler
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.tokenizer import load_decoder, load_tokenizer
from hetero_pd.outputs import Logprob, PromptLogprobs, RequestOutput
from hetero_pd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Steps in a row in which every request failed: then the engine itself is broken.
MAX_FAILED_STEPS = 3
LayerHookFactory = Callable[[SchedulerOutput], Callable[[int], None] | None]
log = logging.getLogger("hetero_pd.engine")


class LLMEngine(HiddenPrompts):
    """One model on one device: add requests, `step()` them, read their outputs. Prompts
    given as hidden states (edge devices) enter through `HiddenPrompts`."""

    def __init__(
        self,
        config: EngineConfig,
        kv_allocator: KVAllocator | None = None,
        disk_key: bytes | None = None,
    ) -> None:
        """`disk_key`: the MAC key of the SSD KV tier's files (a deployment's; None: one
        per process, so files of an earlier process are not trusted)."""
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_config = cfg = ModelConfig.from_dir(self.model_path)
        self.max_model_len = max_model_len(config, cfg, self.model_path)
        self.device = parse_device(config.device)
        backend = backend_for(self.device)
        backend.require_available()
        self.thread_governor = thread_governor(config, self.device, backend)
        self.dtype_choice = config.dtype_choice(cfg.checkpoint_dtype)
        self.compile_choice = config.compile_choice()
        dtype = self.dtype_choice.dtype
        self.decoder = load_decoder(self.model_path)  # output ids -> text
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.runner, self.ranks, num_blocks = load_runner(
            config,
            self.model_path,
            cfg,
            dtype,
            self.max_model_len,
            self.compile_choice[0],
            kv_allocator,
        )
        # Prompt token ids of split requests are placeholders: hashing them would alias.
        caching = config.enable_prefix_caching and config.start_layer == 0
        tiers = None
        if (tier_config := config.kv_tiers) is not None:
            kv = self.runner.kv_tensors
            tiers = build_kv_tiers(
                tier_config, self.model_path, kv, self.runner.kv_layout, disk_key
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, caching, tiers)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            role=config.role,
        )
        self.scheduler = Scheduler(sched_cfg, self.kv)
        draft_kv = (num_blocks, config.block_size, config.max_num_batched_tokens)
        self.speculator = build_speculator(
            config.speculative_config, self.max_model_len, self.model_path, draft_kv,
            self.device, dtype,
        )  # fmt: skip
        eos = self.decoder.eos_token_id  # the tokenizer's, besides the model config's
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | {int(e) for e in [eos] if e is not None}
        self.outputs = OutputBuilder(self.decoder)
        self.grammars = GrammarCompiler(self.model_path, cfg.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self._failures: list[RequestFailure] = []
        self._failed_steps = 0
        self.costs = StepCosts()
        log.info("%s", self.describe())

    def describe(self) -> str:
        """One line saying what runs where and how, printed at start."""
        choice = self.dtype_choice
        return (
            f"engine: {self.model_path.name} on {self.device}, dtype {choice.name} "
            f"({choice.reason}), {torch.get_num_threads()} threads, decode step "
            f"{'compiled' if self.runner.compiled else 'eager'} ({self.compile_choice[1]})"
        )

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's whole tokenizer (transformers), loaded only when something tokenizes."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        if self.config.start_layer:
            raise ValueError("a split engine takes hidden states: use add_split_request")
        req = self._new_request(prompt, params, request_id, priority)
        try:
            self.scheduler.add_request(req)
        except BaseException:
            self.outputs.drop(req.request_id)
            raise
        self.outputs.track(req)
        return req

    def add_remote_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        reuse_prefix: bool = False,
    ) -> list[int]:
        """Decode role: reserves KV blocks for a prompt another worker prefills; returns them.
        With `reuse_prefix` the first `cached_tokens(request_id)` tokens' blocks come from
        this engine's prefix cache: only the rest need to arrive.

        Raises NoFreeBlocksError when the cache cannot hold the prompt now."""
        req = self._new_request(prompt_token_ids, params, request_id, priority)
        block_ids = self.scheduler.add_remote(req, reuse_prefix)
        self.outputs.track(req)
        return block_ids

    def remote_kv_ready(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: dict[int, Logprob] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> RequestOutput:
        """The prompt's KV landed in the reserved blocks: join the decode batch. The worker
        that computed the prompt gives the first token's logprobs and the prompt's when the
        request asks for them (raises ValueError when they are missing)."""
        adopt_remote_logprobs(
            self.scheduler.get(request_id), first_token_id, first_logprobs, prompt_logprobs
        )
        req = self.scheduler.remote_kv_ready(request_id, first_token_id)
        if req.generator is not None and not req.params.greedy:
            advance_generator(req.generator, self.model_config.vocab_size)
        return self._make_output(req, [first_token_id])

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of a request whose KV this engine's prefix cache served."""
        return self.scheduler.get(request_id).num_cached_tokens

    def remote_kv_failed(self, request_id: str) -> None:
        """The KV never arrived: prefill the prompt here (the recompute policy)."""
        self.scheduler.remote_kv_failed(request_id)

    def release_held(self, request_id: str) -> None:
        """Prefill role: the request's KV was handed off (or given up); free its blocks."""
        self.scheduler.release_held(request_id)

    def _new_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
    ) -> Request:
        params = params or SamplingParams()
        self._check_params(params)
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self._check_token_ids(self.tokenize(prompt))
        else:
            text, token_ids = None, self._check_token_ids(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(
            rid, token_ids, params, self.eos_token_ids, priority=priority, generator=generator
        )
        req.grammar = self.grammars.for_params(params)
        self.outputs.remember_prompt(rid, text)
        return req

    def _check_token_ids(self, prompt: Any) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError("a prompt must be a string or a list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return list(prompt)

    def _check_params(self, params: SamplingParams) -> None:
        """Token ids in sampling parameters index the logits: they must be in the vocabulary;
        one completion per engine request (n fans out above the engine)."""
        check_engine_params(params, self.model_config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.outputs.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        """Whether the engine still holds the request (queued, running, remote or held)."""
        return request_id in self.scheduler.requests

    def is_held(self, request_id: str) -> bool:
        """Prefill role: whether the request's prompt is done and its KV held for hand-off."""
        return request_id in self.scheduler.held

    def held_blocks(self, request_id: str) -> tuple[list[int], int]:
        """Prefill role: (block ids, prompt tokens) of a held request's KV."""
        req = self.scheduler.held[request_id]
        return list(req.block_ids), req.num_prompt_tokens

    def load(self) -> EngineLoad:
        s, c = self.scheduler, self.costs
        return EngineLoad(
            waiting=len(s.waiting),
            running=len(s.running),
            remote=len(s.remote),
            held=len(s.held),
            waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
            kv_usage=round(self.kv.usage, 4),
            free_blocks=self.kv.num_free_blocks,
            used_blocks=self.kv.num_used_blocks,
            prompt_tokens_computed=c.prompt_tokens_computed,
            decode_step_s=c.decode_step_s,
            prompt_token_s=c.prompt_token_s,
        )

    def switch_role(self, role: Role) -> None:
        """Serve as `role` from now on; only an idle engine (nothing queued or held) may."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"an engine switches between prefill and decode, not {role!r}")
        if self.has_unfinished_requests() or self.scheduler.held:
            raise RuntimeError("the engine must be idle to switch roles")
        self.config = replace(self.config, role=role)
        self.scheduler.switch_role(role)

    def pop_failures(self) -> list[RequestFailure]:
        """Requests ended because running them raised, since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def share_cpus(self, board: HostBoard) -> None:
        """Share this host's CPUs with the workers on ``board`` (backends/cpu_share.py)."""
        if self.thread_governor is not None:
            self.thread_governor.board = board

    def idle(self) -> None:
        """Nothing to step: the board (if any) hears that this engine holds no CPU."""
        if self.thread_governor is not None:
            self.thread_governor.idle()

    # -- one step ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHookFactory | None = None) -> list[RequestOutput]:
        """Runs one batch; returns an output for every request that got a new token.

        `layer_hook`, if given, sees the step's schedule before the forward pass and may
        return a callback run after each layer (layer-wise KV streaming uses it)."""
        if self.speculator is not None and self.config.role != "prefill":
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if not out:  # e.g. every request waits for its KV: hold no CPU meanwhile
            self.idle()
            return []
        if self.thread_governor is not None:
            self.thread_governor.tick()
        step = self.costs.start(out)
        try:
            outputs = self._run(out, layer_hook)
            self.costs.done(step)
        except EngineFault:  # the engine's own (a tensor-parallel rank died): no retry
            raise
        except Exception as e:  # find out whether one request caused it
            log.warning(
                "a step of %d requests failed (%r); running them one by one", len(out.chunks), e
            )
            outputs = self._run_each(out, layer_hook, e)
        self._failed_steps = 0
        return outputs

    def _run(
        self, out: SchedulerOutput, layer_hook: LayerHookFactory | None
    ) -> list[RequestOutput]:
        on_layer_done = layer_hook(out) if layer_hook is not None else None
        sampled = self.runner.execute(out, on_layer_done)
        if self.speculator is not None:
            self.speculator.observe(out, sampled)
        self.scheduler.update(out, sampled)  # cuts a run where its request finishes
        reqs = {c.request.request_id: c.request for c in out.chunks}
        outputs = []
        for rid, tokens in sampled.items():
            try:
                outputs.append(self._make_output(reqs[rid], tokens))
            except Exception as e:  # this request's output only
                self._fail(reqs[rid], e)
        return outputs

    def _run_each(
        self, out: SchedulerOutput, layer_hook: LayerHookFactory | None, first: Exception
    ) -> list[RequestOutput]:
        """Reruns a failed step one request at a time (nothing of it was recorded, and
        recomputing the same positions rewrites the same KV): the requests that fail alone
        end with an error, the rest go on. When every request fails, again and again, the
        fault is the engine's, not a request's."""
        outputs: list[RequestOutput] = []
        failed = 0
        for chunk in out.chunks:
            try:
                outputs += self._run(SchedulerOutput([chunk]), layer_hook)
            except Exception as e:  # this request only
                self._fail(chunk.request, e)
                failed += 1
        if failed == len(out.chunks):
            self._failed_steps += 1
            if len(out.chunks) > 1 or self._failed_steps >= MAX_FAILED_STEPS:
                raise EngineFault(
                    f"every request of {self._failed_steps} step(s) failed"
                ) from first
        return outputs

    def _fail(self, req: Request, error: Exception) -> None:
        log.warning("request %s failed: %r", req.request_id, error)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self.outputs.drop(req.request_id)
        message = (
            f"the engine could not run request {req.request_id}: {type(error).__name__}: {error}"
        )
        self._failures.append(RequestFailure(req.request_id, message))

    def _make_output(self, req: Request, tokens: list[int]) -> RequestOutput:
        return self.outputs.make(req, tokens, self.scheduler.finish)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Unit vectors of ``inputs`` (engine/pooling.py): no request, no KV kept."""
        return embed(self.runner, inputs)

    def kv_tier_stats(self) -> KVTierStats | None:
        """Hits and bytes per KV tier and onload times; None without host/SSD tiers."""
        return self.kv.tier_stats()

    def check_ranks(self) -> None:
        """Raises TPRankError (an EngineFault) if a tensor-parallel rank has exited."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stops the KV tiers' copy threads, releases their SSD folder and stops the other
        tensor-parallel ranks."""
        self.kv.close()
        if self.ranks is not None:
            self.ranks.close()
