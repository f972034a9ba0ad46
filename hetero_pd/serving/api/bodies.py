"""Request bodies decoded with their cost bounded before Python walks them.

A body of up to 16 MiB is decoded by msgspec, in C, into one struct of raw JSON fields
(`msgspec.Raw`): fields the API does not read are skipped without making an object, and each
field it reads is decoded on its own, only once its size or element count is known to be
within what a valid value of it needs:

- ``prompt`` (completions): a string; token ids, counted by their commas (in C) against the
  model's ``max_model_len`` before one is decoded; or a batch of at most ``MAX_PROMPTS``;
- ``messages``: at most ``MAX_MESSAGES``, each with at most ``MAX_CONTENT_PARTS`` parts;
- ``tokens`` (/detokenize): counted by their commas against ``max_model_len`` (no request
  makes more text);
- ``input`` (/v1/embeddings): a string; token ids, counted as a prompt's are; or a batch of
  at most ``MAX_EMBED_INPUTS``, each counted alike;
- every other field: at most ``SMALL_FIELD_BYTES`` of JSON (``stop`` and ``logit_bias``
  somewhat more, what their most entries of the longest kind take).

msgspec checks a list's ``max_length`` only once it has built the whole list; here a
bounded list is decoded into an array-like struct with one optional field per allowed
element, which stops at the first element past them. So no field costs more than its
largest valid value, and the whole decode is a few passes over the bytes in C: 30-90 ms for
16 MiB of integers on a shared 2-core machine (the Python walk this replaced took 4.7-10 s).
msgspec holds the GIL while it decodes, so bodies larger than a few hundred KiB are decoded
in a process of their own (`body_process`), and the event loop never waits for one.

The result is the plain dict the field parsers (`fields`, `protocol`, `sampling`,
`tokens`) read, with only the fields the client sent; they check each value and name it.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from typing import Any, Literal

import msgspec

from hetero_pd.serving.api.errors import APIError, bad_request
from hetero_pd.serving.api.fields import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_PROMPTS
from hetero_pd.serving.api.protocol import UNSUPPORTED
from hetero_pd.serving.api.structured import FIELDS as STRUCTURED_FIELDS
from hetero_pd.serving.api.tokens import too_many_ids
from hetero_pd.serving.api.tools import FIELDS as TOOL_FIELDS
from hetero_pd.serving.control.sampling import (
    MAX_EMBED_INPUTS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)

BodyKind = Literal["completion", "chat", "tokenize", "detokenize", "embedding"]

#: Most JSON one plain field (a number, a flag, a name, an unsupported feature) may take.
SMALL_FIELD_BYTES = 64 * 1024
#: Fields whose valid values may be larger: every stop string at its longest, each
#: character a 6-byte escape; every logit_bias entry with room for spaces and long floats.
FIELD_BYTES = {
    "stop": MAX_STOP_STRINGS * (MAX_STOP_CHARS * 6 + 8) + 64,
    "logit_bias": MAX_LOGIT_BIAS * 64,
}
#: Bodies up to this size have a lone surrogate located to its field (an error message only).
_DIAGNOSE_BYTES = 1 << 20

_SMALL_FIELDS = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "seed",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "priority",
    "user",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "encoding_format",
    "dimensions",
    *UNSUPPORTED,
    *STRUCTURED_FIELDS,
    *TOOL_FIELDS,
)


def _raw_fields(name: str, *fields: str) -> type[msgspec.Struct]:
    """A struct of these fields, each kept as raw JSON; any other field is skipped."""
    return msgspec.defstruct(name, [(f, msgspec.Raw, msgspec.UNSET) for f in fields])


#: A request body as the tokenizer thread gets it: the raw bytes (decoded there), or the
#: fields already decoded in the decoder process (`body_process`, for large bodies).
Body = bytes | dict[str, Any]

_Body = _raw_fields("_Body", *_SMALL_FIELDS, "prompt", "messages", "tokens", "input")
_Message = _raw_fields("_Message", "role", "content", "tool_calls")
_Part = _raw_fields("_Part", "type", "text")
Scalar = str | int | float | bool | None
_FIRST = re.compile(rb"\s*(.)", re.S)


def decode_body(raw: bytes, kind: BodyKind, max_prompt_ids: int) -> dict[str, Any]:
    """The fields of a request body that `kind`'s parser reads, each decoded within its bound
    (``max_prompt_ids``: the most token ids one completion prompt, one /detokenize or one
    embeddings input can have). 400 when the body is not a JSON object, or a field is larger
    than any valid value of it."""
    body = _top(raw)
    out: dict[str, Any] = {}
    for name in _SMALL_FIELDS:
        value = getattr(body, name)
        if value is not msgspec.UNSET:
            out[name] = _small(value, name, FIELD_BYTES.get(name, SMALL_FIELD_BYTES))
    if kind in ("completion", "tokenize") and body.prompt is not msgspec.UNSET:
        if kind == "completion":
            out["prompt"] = _prompt(body.prompt, max_prompt_ids)
        else:
            out["prompt"] = _text(body.prompt, "prompt")
    if kind in ("chat", "tokenize") and body.messages is not msgspec.UNSET:
        out["messages"] = _messages(body.messages)
    if kind == "detokenize" and body.tokens is not msgspec.UNSET:
        out["tokens"] = _ids(body.tokens, "tokens", max_prompt_ids, too_many_ids)
    if kind == "embedding" and body.input is not msgspec.UNSET:
        out["input"] = _input(body.input, max_prompt_ids)
    return out


def fields_of(body: Body, kind: BodyKind, max_prompt_ids: int) -> dict[str, Any]:
    """The decoded fields of ``body``: `decode_body` of raw bytes, or the fields the decoder
    process already decoded (with the same ``kind`` and bound)."""
    return body if isinstance(body, dict) else decode_body(body, kind, max_prompt_ids)


def _top(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw, type=_Body)
    except msgspec.ValidationError as e:  # the only shape check at the top: an object
        got = str(e).split("got `", 1)[-1].split("`", 1)[0]
        raise bad_request(f"The request body must be a JSON object, got {got}") from None
    except msgspec.DecodeError as e:
        raise _not_json(raw, str(e)) from None
    except RecursionError:
        raise too_deep() from None


def too_deep(param: str | None = None) -> APIError:
    """400: a value nested deeper than any request needs (``param``'s, or the body's)."""
    if param is None:
        return bad_request("The request body nests deeper than any request needs")
    return bad_request(f"'{param}' nests deeper than any request needs", param)


def _small(raw: msgspec.Raw, param: str, limit: int) -> Any:
    if len(raw) > limit:
        raise bad_request(
            f"'{param}' is {len(raw)} bytes of JSON, more than any value of it needs "
            f"(at most {limit})",
            param,
        )
    return _decode(raw, param, Any)


def _decode(raw: msgspec.Raw | bytes, param: str, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:  # e.g. an integer of more than 64 bits
        message, _, path = str(e).partition(" - at `$")
        raise bad_request(f"'{param}{path.rstrip('`')}': {message}", param) from None
    except RecursionError:
        raise too_deep(param) from None


def _first(raw: msgspec.Raw) -> bytes:
    """The first byte of a JSON value (what kind of value it is)."""
    m = _FIRST.match(memoryview(raw))
    return bytes(m.group(1)) if m else b""


def _second(raw: msgspec.Raw) -> bytes:
    """The first byte after an array's ``[``: what kind its first element is."""
    view = memoryview(raw)
    m = _FIRST.match(view)
    m = _FIRST.match(view, m.end()) if m else None
    return bytes(m.group(1)) if m else b""


def _text(raw: msgspec.Raw, param: str) -> Any:
    """A field that is usually a string of any length; anything else only if small."""
    if _first(raw) == b'"':
        return _decode(raw, param, str)
    return _small(raw, param, SMALL_FIELD_BYTES)


def _prompt(raw: msgspec.Raw, max_ids: int) -> Any:
    """A completion prompt: a string, token ids, or a batch of strings or of id lists."""
    if _first(raw) != b"[":
        return _text(raw, "prompt")
    if _second(raw) not in (b'"', b"["):  # a list of token ids
        return _ids(raw, "prompt", max_ids, _too_long_prompt(max_ids))
    items = _bounded(raw, MAX_PROMPTS, "prompt", "prompts")
    return [
        _ids(item, "prompt", max_ids, _too_long_prompt(max_ids))
        if _first(item) == b"["
        else _text(item, "prompt")
        for item in items
    ]


def _ids(raw: msgspec.Raw, param: str, limit: int, too_many: Any) -> Any:
    """A list of token ids: counted by its commas first (a list of numbers has one fewer
    than its elements), so a list too long is refused before any element is made."""
    count = bytes(raw).count(b",") + 1 if len(raw) > 2 else 0
    if count > limit:
        raise too_many(count, limit)
    return _decode(raw, param, list[Scalar])


def _too_long_prompt(max_model_len: int) -> Any:
    def error(count: int, limit: int) -> APIError:
        return bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt "
            f"holds {count} token ids",
            "prompt",
            "context_length_exceeded",
        )

    return error


def _input(raw: msgspec.Raw, max_ids: int) -> Any:
    """An embeddings input: a string, token ids, or a batch of strings or of id lists."""
    if _first(raw) != b"[":
        return _text(raw, "input")
    if _second(raw) not in (b'"', b"["):  # one list of token ids: the first input
        return _ids(raw, "input", max_ids, _too_long_input(0))
    items = _bounded(raw, MAX_EMBED_INPUTS, "input", "items")
    return [
        _ids(item, f"input[{i}]", max_ids, _too_long_input(i))
        if _first(item) == b"["
        else _text(item, f"input[{i}]")
        for i, item in enumerate(items)
    ]


def _too_long_input(i: int) -> Any:
    def error(count: int, limit: int) -> APIError:
        return too_long_input(f"input[{i}]", f"{count} tokens", limit)

    return error


def too_long_input(where: str, size: str, limit: int) -> APIError:
    """400: an embeddings input (``where``) longer than the model's context."""
    return bad_request(
        f"'{where}' has {size}, more than this model's context ({limit} tokens)",
        where,
        "context_length_exceeded",
    )


def _messages(raw: msgspec.Raw) -> Any:
    if _first(raw) != b"[":
        return _small(raw, "messages", SMALL_FIELD_BYTES)
    return [_message(item, i) for i, item in enumerate(_bounded(raw, MAX_MESSAGES, "messages"))]


def _message(raw: msgspec.Raw, i: int) -> Any:
    where = f"messages[{i}]"
    if _first(raw) != b"{":
        return _small(raw, where, SMALL_FIELD_BYTES)
    msg = _decode(raw, where, _Message)
    out: dict[str, Any] = {}
    if msg.role is not msgspec.UNSET:
        out["role"] = _small(msg.role, f"{where}.role", SMALL_FIELD_BYTES)
    if msg.tool_calls is not msgspec.UNSET:
        out["tool_calls"] = _small(msg.tool_calls, f"{where}.tool_calls", SMALL_FIELD_BYTES)
    if msg.content is not msgspec.UNSET:
        out["content"] = _content(msg.content, f"{where}.content")
    return out


def _content(raw: msgspec.Raw, where: str) -> Any:
    if _first(raw) != b"[":
        return _text(raw, where)
    parts = []
    for j, item in enumerate(_bounded(raw, MAX_CONTENT_PARTS, where, "content parts")):
        if _first(item) != b"{":
            parts.append(_small(item, f"{where}[{j}]", SMALL_FIELD_BYTES))
            continue
        part = _decode(item, f"{where}[{j}]", _Part)
        parts.append(
            {
                name: _text(value, f"{where}[{j}].{name}")
                for name in ("type", "text")
                if (value := getattr(part, name)) is not msgspec.UNSET
            }
        )
    return parts


def _bounded(raw: msgspec.Raw, limit: int, param: str, what: str | None = None) -> list[Any]:
    """A JSON array's elements, raw; refused at element ``limit + 1``, before the rest of the
    array is decoded."""
    try:
        items = msgspec.json.decode(raw, type=_bounded_list(limit))
    except msgspec.ValidationError:
        what = what or param
        raise bad_request(
            f"'{param}' holds more than {limit} {what}; at most {limit} are accepted", param
        ) from None
    return list(itertools.takewhile(len, msgspec.structs.astuple(items)))


@functools.cache
def _bounded_list(limit: int) -> type[msgspec.Struct]:
    # An empty Raw marks "no element": JSON has no empty value, so it never comes from a body.
    fields = [(f"i{i}", msgspec.Raw, msgspec.Raw()) for i in range(limit)]
    return msgspec.defstruct(
        f"_Bounded{limit}", fields, array_like=True, forbid_unknown_fields=True
    )


def _not_json(raw: bytes, reason: str) -> APIError:
    """400 for a body msgspec cannot decode; a lone surrogate escape (``"\\ud800"``), which
    JSON can spell but no tokenizer or encoder accepts, is named with its field."""
    if b"\\ud" not in raw and b"\\uD" not in raw:
        return bad_request(f"The request body is not valid JSON: {reason}")
    field = _lone_surrogate_field(raw) if len(raw) <= _DIAGNOSE_BYTES else None
    where = f" in '{field}'" if field else ""
    return bad_request(
        f"The request body is not valid JSON ({reason}): it holds a string that is not valid "
        f"Unicode{where} (a lone surrogate escape such as \\ud800)",
        field,
    )


def _lone_surrogate_field(raw: bytes) -> str | None:
    # The standard library decodes lone surrogates; encoding each field's value back as
    # UTF-8 finds the one that holds them (both in C, on at most _DIAGNOSE_BYTES).
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    for key, value in body.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode()
        except (UnicodeEncodeError, ValueError, RecursionError):
            return str(key.encode("utf-8", "replace").decode())
    return None
