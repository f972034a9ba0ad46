"""OpenAI's ``logprobs`` objects, built from the engine's positions (``dict[int, Logprob]``
per token, the chosen token first, then the alternatives by rank).

Completions (legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
with one entry per token; ``top_logprobs`` maps each listed token's text to its logprob (the
chosen token and the ``logprobs`` most likely ones, as vLLM lists them). With ``echo`` the
prompt's tokens come first, the very first with ``null`` (nothing predicts it).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` where
``top_logprobs`` holds the ``top_logprobs`` most likely tokens by rank.

A token is shown as its text (``tokenizer.decode([id])``, as vLLM does); ``-inf`` (a
banned token) becomes -9999.0, vLLM's stand-in, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetero_pd.outputs import Logprob

Decode = Callable[[int], str]
Entry = dict[int, Logprob]
#: vLLM's value for a logprob of -inf.
FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


@dataclass(slots=True)
class CompletionLogprobs:
    """The completions ``logprobs`` object of one choice, built as its tokens arrive."""

    decode: Decode
    offset: int = 0  # text_offset of the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add_first_prompt_token(self, token: int) -> None:
        self._append(self.decode(token), None, None)

    def add(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            chosen, lp = next(iter(e.items()))
            top = {self.decode(t): _lp(x.logprob) for t, x in e.items()}
            self._append(self.decode(chosen), _lp(lp.logprob), top)

    def _append(self, text: str, lp: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(lp)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def prompt_completion_logprobs(
    decode: Decode, prompt_ids: Sequence[int], prompt: Sequence[Entry | None]
) -> CompletionLogprobs:
    """A choice's logprobs with ``echo``: the prompt's positions first."""
    out = CompletionLogprobs(decode)
    out.add_first_prompt_token(prompt_ids[0])
    out.add([e for e in prompt[1:] if e is not None])
    return out


def chat_logprobs(decode: Decode, entries: Sequence[Entry], num_top: int) -> dict[str, Any]:
    """The chat ``logprobs`` object of these tokens."""
    return {"content": [_chat_token(decode, e, num_top) for e in entries]}


def _chat_token(decode: Decode, e: Entry, num_top: int) -> dict[str, Any]:
    chosen, lp = next(iter(e.items()))
    by_rank = sorted(e.items(), key=lambda item: item[1].rank)[:num_top]
    return {
        **_chat_entry(decode(chosen), lp.logprob),
        "top_logprobs": [_chat_entry(decode(t), x.logprob) for t, x in by_rank],
    }


def _chat_entry(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}
