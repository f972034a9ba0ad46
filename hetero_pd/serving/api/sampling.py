"""The OpenAI request fields that shape sampling beyond the basics: ``n`` (``best_of`` only
when equal to it), ``presence_penalty``, ``frequency_penalty``, vLLM's
``repetition_penalty``, ``logit_bias``, and the log-probability fields (completions:
``logprobs: int`` and ``echo``; chat: ``logprobs: bool`` and ``top_logprobs``).

``sampling_fields`` reads them into ``SamplingParams`` keyword arguments. Each value is
checked here against the control protocol's ranges, with a 400 naming the field;
``logit_bias`` token ids are checked against the model's vocabulary by
``protocol.check_sampling_limits`` (the parser does not know the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from hetero_pd.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, MAX_N
from hetero_pd.serving.api.errors import bad_request
from hetero_pd.serving.api.fields import opt_bool, opt_int, opt_number, show
from hetero_pd.serving.control.sampling import MAX_LOGIT_BIAS

PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]


def sampling_fields(
    b: Mapping[str, Any], kind: Literal["completion", "chat"]
) -> tuple[dict[str, Any], bool]:
    """``SamplingParams`` keyword arguments for these fields, and whether to echo the prompt
    (completions only)."""
    kwargs: dict[str, Any] = {}
    n = opt_int(b, "n", minimum=1)
    if n is not None:
        kwargs["n"] = _at_most(n, MAX_N, "n")
    best_of = opt_int(b, "best_of", minimum=1)
    if best_of is not None and best_of != (n or 1):
        raise bad_request(
            f"'best_of' must equal 'n' ({n or 1}): this server returns every completion it "
            f"samples, got best_of={best_of}",
            "best_of",
            "unsupported_parameter",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = opt_number(b, name)
        if value is not None:
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise bad_request(f"'{name}' must be in [-2, 2], got {value}", name)
            kwargs[name] = value
    repetition = opt_number(b, "repetition_penalty")
    if repetition is not None:
        if not 0 < repetition <= 1e6:
            raise bad_request(
                f"'repetition_penalty' must be in (0, 1e6], got {repetition}", "repetition_penalty"
            )
        kwargs["repetition_penalty"] = repetition
    bias = logit_bias(b.get("logit_bias"))
    if bias:
        kwargs["logit_bias"] = bias
    echo = False
    if kind == "completion":
        # `false` (what chat clients send) is "not given"; `true` says no number.
        num = None if b.get("logprobs") is False else opt_int(b, "logprobs", minimum=0)
        echo = bool(opt_bool(b, "echo"))
        if num is not None:
            kwargs["logprobs"] = _at_most(num, MAX_LOGPROBS, "logprobs")
            if echo:
                kwargs["prompt_logprobs"] = kwargs["logprobs"]
    else:
        wanted = opt_bool(b, "logprobs")
        top = opt_int(b, "top_logprobs", minimum=0)
        if top and not wanted:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if wanted:
            kwargs["logprobs"] = _at_most(top or 0, MAX_LOGPROBS, "top_logprobs")
    return kwargs, echo


def logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object from token ids (as JSON keys, so strings) to a bias
    in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(
            f"'logit_bias' must be an object from token ids to numbers, got {show(value)}",
            "logit_bias",
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' holds {len(value)} entries, at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = str(key)
        if not token.isascii() or not token.isdigit() or len(token) > 10:
            raise bad_request(
                f"'logit_bias' keys must be token ids (integers >= 0), got {show(key)}",
                "logit_bias",
            )
        number = opt_number({"logit_bias": bias}, "logit_bias")
        if number is None or not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT:
            raise bad_request(
                f"'logit_bias' values must be numbers in [-100, 100], got {show(bias)} for "
                f"token {token}",
                "logit_bias",
            )
        out[int(token)] = number
    return out


def _at_most(value: int, limit: int, name: str) -> int:
    if value > limit:
        raise bad_request(f"'{name}' must be at most {limit}, got {value}", name)
    return value
