"""A request's outputs as it generates: incremental detokenizing, stop strings, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetero_pd.engine.detokenizer import Detokenizer, detokenizer
from hetero_pd.engine.logprobs import output_logprobs, prompt_logprobs
from hetero_pd.engine.request import Request, RequestStatus
from hetero_pd.engine.stop import StopChecker
from hetero_pd.outputs import CompletionOutput, RequestOutput
from hetero_pd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hetero_pd.models.tokenizer import TokenDecoder

Finish = Callable[[Request, RequestStatus], None]


@dataclass(slots=True)
class _OutputState:
    prompt: str | None
    detok: Detokenizer
    stop: StopChecker
    sent_len: int = 0


class OutputBuilder:
    """Per request: what has been sent of its text, and where a stop string cuts it."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _OutputState] = {}
        self._prompts: dict[str, str] = {}

    def remember_prompt(self, request_id: str, text: str | None) -> None:
        """The prompt's text, for the request's outputs (None: it came as token ids)."""
        if text is not None:
            self._prompts[request_id] = text

    def track(self, req: Request) -> None:
        """Starts a request whose prompt is token ids."""
        self._states[req.request_id] = _OutputState(
            self._prompts.pop(req.request_id, None),
            detokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens),
            StopChecker.from_params(req.params),
        )

    def track_hidden(self, request_id: str, params: SamplingParams) -> None:
        """Starts a request whose prompt came as hidden states (no text, no token ids)."""
        self._states[request_id] = _OutputState(
            None,
            detokenizer(self.tokenizer, [], params.skip_special_tokens),
            StopChecker.from_params(params),
        )

    def sent_chars(self, request_id: str) -> int:
        """Characters of the request's text its outputs have carried so far."""
        return self._states[request_id].sent_len

    def replay(self, req: Request) -> int:
        """Brings a request tracked from its prompt up to its output tokens (a migrated
        request: the detokenizer and the stop matcher see every token again, as on the
        worker it came from); returns the characters its outputs carried. Raises
        ValueError when a stop string had already ended it."""
        state = self._states[req.request_id]
        for token in req.output_token_ids:
            delta = state.detok.add(token)
            if state.stop and state.stop.check(state.detok.text, len(delta)) is not None:
                raise ValueError(f"request {req.request_id}: a stop string ended it already")
        text = state.detok.text
        state.sent_len = state.stop.streamable_text_len(text) if state.stop else len(text)
        return state.sent_len

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def make(self, req: Request, tokens: list[int], finish: Finish) -> RequestOutput:
        """The output for `req`'s new `tokens` (one, or a speculative run): its text so
        far, held back while it could still turn into a stop string, and cut at one when it
        has (then `finish` ends the request in the scheduler, and the run's tokens after the
        one that completed the stop string are dropped, as if never generated)."""
        state = self._states[req.request_id]
        finished = req.status.finished or req.status is RequestStatus.KV_READY
        first_new = req.num_output_tokens - len(tokens)
        match = None
        for i, token in enumerate(tokens):
            delta = state.detok.add(token)
            if finished and i == len(tokens) - 1:
                delta += state.detok.flush()
            match = state.stop.check(state.detok.text, len(delta)) if state.stop else None
            if match is not None:
                if i < len(tokens) - 1:
                    tokens = tokens[: i + 1]
                    req.drop_outputs_after(first_new + i + 1)
                break
        text = state.detok.text
        if match is not None:
            text = text[: match.text_len]
            if not finished:
                finish(req, RequestStatus.FINISHED_STOPPED)
                finished = True
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = match.stop_str
        visible = len(text) if finished or not state.stop else state.stop.streamable_text_len(text)
        delta_text = text[state.sent_len : visible]
        state.sent_len = visible
        if finished:
            del self._states[req.request_id]
        completion = CompletionOutput(
            index=0,
            text=text[:visible],
            token_ids=req.output_token_ids,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta_text,
            delta_token_ids=list(tokens),
        )
        completion.logprobs, completion.cumulative_logprob = output_logprobs(req)
        return RequestOutput(
            req.request_id,
            state.prompt,
            req.prompt_token_ids,
            [completion],
            finished,
            req.num_cached_tokens,
            prompt_logprobs(req),
        )
