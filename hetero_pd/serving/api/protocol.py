"""OpenAI API requests: parsing and validation into a :class:`GenerateRequest`.

The request itself is ``request.GenerateRequest``; errors and the API key check are in
``errors``, the response and SSE builders in ``responses``, the typed field readers and the
prompt/messages parsers in ``fields``.

Pure functions, no I/O: the router reads the body, calls ``parse_*_request`` and JSON-encodes
what the builders return. Every rejection is an :class:`APIError` (400) that names the
offending field in ``param``. Unknown fields are ignored (clients send extras); fields that
would change the output in a way we cannot honour (tools, JSON mode, ``suffix``, ...) are
rejected, never silently dropped. ``n``, penalties, ``logit_bias``, ``logprobs`` and
completion ``echo`` are read by ``sampling``; ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` by ``structured``. ``null`` means "not given" for every
optional field, as in OpenAI's API.

A stream, as OpenAI sends it::

    data: {"choices": [{"delta": {"role": "assistant", "content": ""}}], ...}   (chat only)
    data: {"choices": [{"delta": {"content": "Hel"}}], ...}   ... one per text delta
    data: {"choices": [{"delta": {}, "finish_reason": "stop"}], ...}
    data: {"choices": [], "usage": {...}}           (only with stream_options.include_usage)
    data: [DONE]
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.api.errors import (
    bad_request,
)
from hetero_pd.serving.api.fields import (
    json_object,
    opt_bool,
    opt_int,
    opt_number,
    parse_messages,
    parse_prompts,
    same_json,
    show,
)
from hetero_pd.serving.api.request import GenerateRequest, RequestKind
from hetero_pd.serving.api.sampling import sampling_fields
from hetero_pd.serving.api.structured import check_constraint, structured_outputs
from hetero_pd.serving.api.tools import DEFAULT_TOOLS, ToolSettings, parse_tools
from hetero_pd.serving.control.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, WireParams

__all__ = [
    "PRIORITY_LIMIT",
    "UNSUPPORTED",
    "check_context_length",
    "check_sampling_limits",
    "parse_chat_request",
    "parse_completion_request",
]

#: OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to "until EOS".
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: A request's priority (lower is served first, as in vLLM) is clamped into
#: [-PRIORITY_LIMIT, PRIORITY_LIMIT]; only API keys the deployment allows may set it.
PRIORITY_LIMIT = 10


# Fields we cannot honour, and the values that leave the output unchanged (so they pass).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "use_beam_search": (False,),
}


def parse_completion_request(body: Any) -> GenerateRequest:
    """Validate a /v1/completions body (as the openai client and ``vllm bench`` send it)."""
    b = json_object(body)
    prompts = parse_prompts(b.get("prompt"))
    prompt, token_ids = prompts[0]
    max_tokens = opt_int(b, "max_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    batch = prompts if len(prompts) > 1 else []
    return _request(
        "completion", b, max_tokens, prompt=prompt, prompt_token_ids=token_ids, batch=batch
    )


def parse_chat_request(body: Any, tools: ToolSettings = DEFAULT_TOOLS) -> GenerateRequest:
    """Validate a /v1/chat/completions body; ``max_completion_tokens`` wins over the
    deprecated ``max_tokens``, and neither means "until EOS or the model's length"."""
    b = json_object(body)
    if b.get("echo") not in (None, False):
        # vLLM's chat `echo` repeats the last message; not served here.
        raise bad_request(
            f"'echo' is not supported for chat completions (got {show(b['echo'])})",
            "echo",
            "unsupported_parameter",
        )
    messages = parse_messages(b.get("messages"))
    max_tokens = opt_int(b, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = opt_int(b, "max_tokens", minimum=1)
    return _request("chat", b, max_tokens, tools, messages=messages)


def check_context_length(req: GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens ``req`` may generate after a ``num_prompt_tokens`` prompt.

    Raises 400 (code ``context_length_exceeded``) when the prompt leaves no room, or the
    prompt plus an explicit ``max_tokens`` does not fit in ``max_model_len``.
    """
    param = "messages" if req.kind == "chat" else "prompt"
    asked = req.params.max_tokens
    room = max_model_len - num_prompt_tokens
    if room < 1 or (asked is not None and asked > room):
        wanted = f"{num_prompt_tokens + (asked or 0)} tokens ({num_prompt_tokens} in the {param}"
        wanted += f", {asked} in the completion)" if asked is not None else ")"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted}. Please reduce the length of the {param} or completion.",
            param,
            "context_length_exceeded",
        )
    return room if asked is None else asked


def check_sampling_limits(params: SamplingParams, vocab_size: int) -> None:
    """400 for sampling values the workers could not take: token ids outside the model's
    vocabulary, numbers beyond the control protocol's ranges (e.g. ``top_k: 2**70``)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = [t for t in ids or () if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(
                f"'{name}' token ids {[show(t) for t in bad[:5]]} are outside the model's "
                f"vocabulary [0, {vocab_size})",
                name,
            )
    try:
        msgspec.convert(msgspec.structs.asdict(WireParams.of(params)), WireParams)
    except msgspec.ValidationError as e:
        name = str(e).rsplit("$.", 1)[-1].split("[", 1)[0].split(".", 1)[0].rstrip("`")
        raise bad_request(f"a sampling parameter is out of range: {e}", name or None) from None


def _request(
    kind: RequestKind,
    b: dict[str, Any],
    max_tokens: int | None,
    tool_settings: ToolSettings = DEFAULT_TOOLS,
    **inputs: Any,
) -> GenerateRequest:
    model = b.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    for name, neutral in UNSUPPORTED.items():
        value = b.get(name)
        if value is not None and not any(same_json(value, n) for n in neutral):
            keep = f" or set it to {json.dumps(neutral[0])}" if neutral else ""
            raise bad_request(
                f"'{name}' is not supported by this server (got {show(value)}); remove it{keep}",
                name,
                "unsupported_parameter",
            )
    stream = bool(opt_bool(b, "stream"))
    options = b.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = opt_bool(options or {}, "include_usage", "stream_options.include_usage")
    priority = opt_int(b, "priority") or 0  # checked against the API key, clamped: generate
    user = b.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'user' must be a string, got {show(user)}", "user")
    extra, echo = sampling_fields(b, kind)
    params = _sampling_params(b, max_tokens, extra)
    tools = parse_tools(b, kind == "chat", tool_settings)
    forced = tools.constraint() if tools is not None else None
    if tools is not None and tools.parser == "mistral":
        params.skip_special_tokens = False  # [TOOL_CALLS] is a special token (as vLLM does)
    if forced is not None:
        if params.structured_outputs is not None:
            raise bad_request(
                f"'tool_choice' {show(b.get('tool_choice'))} constrains the output already: "
                "leave out response_format / structured_outputs / guided_*",
                "tool_choice",
            )
        check_constraint("tools", forced)
        params.structured_outputs = forced
    return GenerateRequest(
        kind=kind,
        model=model,
        params=params,
        tools=tools,
        stream=stream,
        echo=echo,
        include_usage=stream and bool(include_usage),
        priority=priority,
        user=user,
        **inputs,
    )


def _sampling_params(
    b: dict[str, Any], max_tokens: int | None, extra: dict[str, Any]
) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, **extra}
    for name in ("temperature", "top_p", "min_p"):
        if (number := opt_number(b, name)) is not None:
            kwargs[name] = number
    for name in ("top_k", "seed", "min_tokens"):
        if (integer := opt_int(b, name)) is not None:
            kwargs[name] = integer
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        if (flag := opt_bool(b, name)) is not None:
            kwargs[name] = flag
    stop = b.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request(f"'stop' must be a string or a list of strings, got {show(stop)}", "stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(stops)} strings, at most {MAX_STOP_STRINGS}", "stop")
    if any(isinstance(x, str) and len(x) > MAX_STOP_CHARS for x in stops):
        raise bad_request(f"'stop' strings must be at most {MAX_STOP_CHARS} characters", "stop")
    kwargs["stop"] = stop
    ids = b.get("stop_token_ids")
    if ids is not None and not isinstance(ids, list):
        raise bad_request(
            f"'stop_token_ids' must be a list of integers, got {show(ids)}", "stop_token_ids"
        )
    kwargs["stop_token_ids"] = ids
    kwargs["structured_outputs"] = structured_outputs(b)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        # SamplingParams messages start with the field's name: "top_p must be in (0, 1], ..."
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), name if name in kwargs else None) from e
