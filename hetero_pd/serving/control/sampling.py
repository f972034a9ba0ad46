"""Sampling values on the control wire: `WireParams` (every `SamplingParams` field, bounded)
and log-probabilities (`TokenLogprob`, one `Position` per token), with their conversions.

A position is the chosen token's entry first, then the alternatives by rank, exactly the
engine's `dict[int, Logprob]` in order; it travels as arrays (`[token, logprob, rank]`) so
that a prompt's logprobs stay compact. `hetero_pd.serving.control.protocol` carries these inside
its messages; they are declared here to keep that module to the messages themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hetero_pd.outputs import Logprob, PromptLogprobs, SampleLogprobs
from hetero_pd.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, MAX_N, SamplingParams
from hetero_pd.structured_outputs import MAX_SPEC_BYTES, StructuredOutputsParams

MAX_TOKENS = 1 << 20
#: Most inputs one Embed carries (OpenAI takes up to 2048 per request); here beside the
#: other limits the API's body decoder reads, in a module that does not import torch.
MAX_EMBED_INPUTS = 2048
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
#: Most `logit_bias` entries one request may carry.
MAX_LOGIT_BIAS = 4096

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKENS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]


class WireValue(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A nested value of a control message."""


class WireConstraint(WireValue, frozen=True):
    """`StructuredOutputsParams` on the wire: its kind and its spec (schema JSON, regex,
    grammar, choices as JSON), bounded. A decode worker compiles it again and advances the
    matcher over the first token, which the prefill worker sampled under it."""

    kind: Literal["json", "regex", "choice", "grammar", "json_object"]
    # Characters: at most MAX_SPEC_BYTES bytes once `to_params` checks the UTF-8 size.
    spec: Annotated[str, Meta(max_length=MAX_SPEC_BYTES)]

    @classmethod
    def of(cls, params: StructuredOutputsParams | None) -> WireConstraint | None:
        if params is None:
            return None
        kind, spec = params.key()
        return cls(kind=kind, spec=spec)

    def to_params(self) -> StructuredOutputsParams:
        """Raises ValueError when the spec is malformed or too large."""
        return StructuredOutputsParams.from_key(self.kind, self.spec)


class WireParams(WireValue, kw_only=True, frozen=True):
    """`SamplingParams` on the wire, field for field, bounded; `to_params()` validates every
    value again (tests/serving/test_wire_sampling.py keeps the two field lists equal)."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, Meta(ge=-1, lt=2**31)] = 0
    min_p: float = 0.0
    seed: int | None = None  # msgpack integers fit [-2**63, 2**64) already
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
        Meta(max_length=MAX_STOP_STRINGS),
    ] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_STRINGS)] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0
    logit_bias: (
        Annotated[
            dict[TokenId, Annotated[float, Meta(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]],
            Meta(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    structured_outputs: WireConstraint | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> WireParams:
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        fields = {f: getattr(params, f) for f in cls.__struct_fields__}
        return cls(
            **{
                **fields,
                "stop": stop,
                "stop_token_ids": list(params.stop_token_ids or []),
                "structured_outputs": WireConstraint.of(params.structured_outputs),
            }
        )

    def to_params(self) -> SamplingParams:
        """Raises ValueError naming the field when a value is not a valid sampling value."""
        fields = msgspec.structs.asdict(self)
        so = self.structured_outputs
        fields["structured_outputs"] = None if so is None else so.to_params()
        return SamplingParams(**fields)


class TokenLogprob(WireValue, array_like=True, frozen=True):
    """One token's log-probability at one position (`hetero_pd.outputs.Logprob`)."""

    token: TokenId
    logprob: float  # -inf for a banned token
    rank: Annotated[int, Meta(ge=1, lt=2**31)]


#: One position: the chosen token first, then the alternatives by rank.
Position = Annotated[list[TokenLogprob], Meta(min_length=1, max_length=MAX_LOGPROBS + 1)]
#: A generated stretch of tokens, one position each.
Positions = Annotated[list[Position], Meta(max_length=MAX_TOKENS)]
#: A prompt: None for its first token (nothing predicts it), then one position per token.
PromptPositions = Annotated[list[Position | None], Meta(max_length=MAX_TOKENS)]


def position(entry: dict[int, Logprob]) -> list[TokenLogprob]:
    return [TokenLogprob(token=t, logprob=lp.logprob, rank=lp.rank) for t, lp in entry.items()]


def positions(entries: Sequence[dict[int, Logprob]]) -> list[list[TokenLogprob]]:
    return [position(e) for e in entries]


def prompt_positions(entries: PromptLogprobs) -> list[list[TokenLogprob] | None]:
    return [None if e is None else position(e) for e in entries]


def entry(pos: Sequence[TokenLogprob]) -> dict[int, Logprob]:
    """The engine's form of one position (the chosen token stays first)."""
    return {t.token: Logprob(t.logprob, t.rank) for t in pos}


def entries(pos: Sequence[Sequence[TokenLogprob]]) -> SampleLogprobs:
    return [entry(p) for p in pos]


def prompt_entries(pos: Sequence[Sequence[TokenLogprob] | None]) -> PromptLogprobs:
    return [None if p is None else entry(p) for p in pos]
