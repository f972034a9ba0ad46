"""Prompts that arrive as hidden states instead of token ids (the edge split): a split
engine's prompt and per-token states, and a whole-model engine's "prompt only" edge
prompt with its early-layer KV. Every value is checked where it enters (value_check)."""

from __future__ import annotations

import torch

from backends import DtypeChoice
from hetero_pd.config import EngineConfig
from hetero_pd.engine.output_builder import OutputBuilder
from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import Scheduler
from hetero_pd.engine.value_check import check_fits
from hetero_pd.models.config import ModelConfig
from hetero_pd.sampling_params import SamplingParams


class HiddenPrompts:
    """LLMEngine's entry points for prompts given as hidden states; what they use of the
    engine is declared here."""

    config: EngineConfig
    model_config: ModelConfig
    dtype_choice: DtypeChoice
    scheduler: Scheduler
    outputs: OutputBuilder

    def _new_request(
        self, prompt: list[int], params: SamplingParams, request_id: str, priority: int
    ) -> Request:
        raise NotImplementedError

    def add_split_request(
        self,
        prompt_hidden: torch.Tensor,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        remote_kv: bool = False,
    ) -> list[int] | None:
        """Split (edge) role: a prompt given as the hidden states after layer
        `start_layer - 1`, [num_tokens, hidden]. With `remote_kv`, reserves blocks for KV
        another worker computes (returns them), else queues the prompt for prefill here."""
        self._require_split()
        return self._add_hidden_prompt(prompt_hidden, None, params, request_id, priority, remote_kv)

    def add_edge_prompt_request(
        self,
        prompt_hidden: torch.Tensor,
        early_kv: torch.Tensor,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        remote_kv: bool = False,
    ) -> list[int] | None:
        """A whole-model engine takes a prompt a device ran through layers [0, k): the hidden
        states entering layer k, [num_tokens, hidden], and those layers' KV,
        [k, 2, num_tokens, kv_heads, head_dim]. The engine runs layers [k, L) on the prompt
        and then decodes alone, from token ids ("prompt only" edge mode). With `remote_kv`,
        reserves blocks for KV another worker computes (returns them)."""
        if self.config.start_layer:
            raise ValueError("a split engine takes add_split_request, not edge prompts")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("edge prompts need tensor_parallel_size 1 (not supported yet)")
        return self._add_hidden_prompt(
            prompt_hidden, early_kv, params, request_id, priority, remote_kv
        )

    def _add_hidden_prompt(
        self,
        prompt_hidden: torch.Tensor,
        early_kv: torch.Tensor | None,
        params: SamplingParams,
        request_id: str,
        priority: int,
        remote_kv: bool,
    ) -> list[int] | None:
        """Queues (or, with `remote_kv`, reserves blocks for) a prompt given as hidden
        states; its token ids are placeholders the engine never reads."""
        cfg = self.model_config
        if prompt_hidden.dim() != 2 or prompt_hidden.shape[1] != cfg.hidden_size:
            raise ValueError(
                f"prompt hidden states must be [num_tokens, {cfg.hidden_size}], "
                f"got {tuple(prompt_hidden.shape)}"
            )
        n = prompt_hidden.shape[0]
        if n == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if early_kv is not None and cfg.mla is not None:
            raise ValueError(
                f"{cfg.architecture} caches MLA latents, not K/V heads: edge prompts with "
                "early-layer KV are not supported for it (send hidden states only)"
            )
        if early_kv is not None:
            k = early_kv.shape[0] if early_kv.dim() == 5 else 0
            want = (k, 2, n, cfg.num_kv_heads, cfg.head_dim)
            if not 1 <= k < cfg.num_layers or tuple(early_kv.shape) != want:
                raise ValueError(
                    f"the prompt's early-layer KV must be [k, 2, {n}, {cfg.num_kv_heads}, "
                    f"{cfg.head_dim}] with 1 <= k < {cfg.num_layers}, "
                    f"got {tuple(early_kv.shape)}"
                )
            check_fits(early_kv, self.dtype_choice.dtype, "early_kv")
        check_fits(prompt_hidden, self.dtype_choice.dtype, "hidden")
        req = self._new_request([0] * n, params, request_id, priority)
        req.prompt_hidden, req.early_kv = prompt_hidden, early_kv
        block_ids = None
        if remote_kv:
            block_ids = self.scheduler.add_remote(req)
        else:
            self.scheduler.add_request(req)
        self.outputs.track_hidden(req.request_id, params)
        return block_ids

    def supply_hidden(self, request_id: str, hidden_row: torch.Tensor) -> None:
        """The device's hidden state for the request's newest token, [1, hidden]."""
        self._require_split()
        req = self.scheduler.get(request_id)
        hidden = self.model_config.hidden_size
        if tuple(hidden_row.shape) != (1, hidden):
            raise ValueError(
                f"a token's hidden state must be [1, {hidden}], got {tuple(hidden_row.shape)}"
            )
        check_fits(hidden_row, self.dtype_choice.dtype, "hidden")
        expected = req.num_tokens - req.num_prompt_tokens
        if len(req.hidden_rows) >= expected:
            raise ValueError(f"request {request_id}: hidden state for a token not sampled yet")
        req.hidden_rows.append(hidden_row)

    def _require_split(self) -> None:
        if self.config.start_layer == 0:
            raise ValueError("this engine is not a split engine (start_layer is 0)")
