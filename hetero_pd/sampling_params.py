"""Per-request sampling parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from hetero_pd.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as 0 (greedy): dividing logits by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64  # exclusive; the range torch.Generator.manual_seed accepts
#: Most alternatives `logprobs` / `prompt_logprobs` may ask for (OpenAI's and vLLM's limit).
MAX_LOGPROBS = 20
#: Most completions one request may ask for (`n`).
MAX_N = 128
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: [-100, 100]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one completion.

    Every field is validated on construction; a bad value raises ``ValueError`` naming the
    field, the value and what is allowed. After construction ``stop`` is always a
    ``list[str]``, ``stop_token_ids`` a ``list[int]``, ``temperature``/``top_p``/``min_p``
    are floats and ``top_k`` is ``0`` when disabled (``-1`` is accepted as an alias).

    Logits are processed in this order before a token is chosen: ``min_tokens`` bans (EOS
    and ``stop_token_ids``), ``logit_bias``, ``repetition_penalty``, ``frequency_penalty``
    and ``presence_penalty``; then greedy rows take the argmax, the others are divided by
    the temperature and masked by top-k, top-p and min-p. ``logprobs`` are the log-softmax
    of the logits after the temperature (1 for greedy rows) and before the masks, so every
    reported value is finite unless a token is banned, and with temperature 0 or 1 and no
    bias or penalty they are the model's own log-probabilities. ``prompt_logprobs`` are
    always the model's own (nothing applied).

    Attributes:
        n: number of completions per prompt (``LLM.generate`` returns ``n`` outputs per
            prompt, sharing the prompt's KV blocks); with a seed, completion ``i`` uses
            ``seed + i``, as vLLM does.
        max_tokens: maximum number of generated tokens; ``None`` means until EOS or the
            model's maximum length.
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass
            reaches ``top_p``; in ``(0, 1]``, ``1`` disables it.
        top_k: keep only the ``top_k`` most likely tokens; ``0`` or ``-1`` disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's;
            in ``[0, 1]``, ``0`` disables it.
        seed: makes sampling for this request reproducible, whatever else is in the batch.
        stop: strings that end generation; they are not part of the output unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: keep generating after the EOS token.
        min_tokens: EOS and ``stop_token_ids`` cannot end generation before this many tokens.
        skip_special_tokens: leave special tokens out of the output text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        presence_penalty: subtracted from the logit of every token already generated, in
            ``[-2, 2]`` (OpenAI: ``mu[j] -= alpha_presence * (c[j] > 0)``).
        frequency_penalty: subtracted once per time a token was generated, in ``[-2, 2]``
            (OpenAI: ``mu[j] -= alpha_frequency * c[j]``).
        repetition_penalty: > 0; logits of tokens in the prompt or the output are divided by
            it when positive and multiplied when negative (transformers' and vLLM's rule);
            ``1`` disables it.
        logit_bias: token id -> bias in ``[-100, 100]`` added to its logit (string keys, as
            JSON has them, are accepted).
        logprobs: also return, for each generated token, its log-probability and the
            ``logprobs`` most likely alternatives (``0``: the chosen token only); at most 20.
        prompt_logprobs: the same for each prompt token after the first (for ``echo``).
        structured_outputs: a constraint the output must satisfy (JSON schema, regex,
            choice, grammar; see ``StructuredOutputsParams``): every token is sampled among
            those the grammar allows, first of all (before bans, bias and penalties), and the
            request stops (``finish_reason`` "stop") when the grammar is complete.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        self.temperature = _finite_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = _finite_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}"
            )
        self.top_k = max(self.top_k, 0)
        self.min_p = _finite_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed < _SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}"
            )
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _finite_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = _finite_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or None, got "
                f"{self.structured_outputs!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens so far (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError naming the field when a token id given here (``stop_token_ids``,
        ``logit_bias`` keys) is outside the model's vocabulary ``[0, vocab_size)``: such an
        id must never reach the logits."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias keys", self.logit_bias),
        ):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of ``n``: one completion, seed + index
        (wrapped into the seed range), prompt logprobs only for the first."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed >= _SEED_MAX:
                seed -= _SEED_MAX
        return dataclasses.replace(
            self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None
        )


def _finite_float(name: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r}")
    return list(items)


def _normalize_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers or None, got {ids!r}")
    for token_id in ids:
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {token_id!r}")
    return list(ids)


def _normalize_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias or None, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and re.fullmatch(r"\s*-?[0-9]+\s*", key):
            token = int(key)  # JSON object keys are strings
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        b = _finite_float(f"logit_bias[{key!r}]", value)
        if not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {value!r}")
        out[token] = b
    return out or None
