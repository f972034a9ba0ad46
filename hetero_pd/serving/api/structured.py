"""The request fields that constrain the output to a structure, read into one
``StructuredOutputsParams``:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar" | "json_object"}``)
  and its older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them per request. Each spec is bounded (``MAX_SPEC_BYTES``; the body decoder
already caps a field's raw JSON) and compiled once here, on the tokenizer thread, with
llguidance's work limits, so that a constraint it cannot enforce is a 400 naming the field
and saying why, not a failure on a worker. Results are cached by spec.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from hetero_pd.serving.api.errors import bad_request
from hetero_pd.serving.api.fields import show
from hetero_pd.structured_outputs import KINDS, StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: Every field read here (the body decoder bounds each like a small field).
FIELDS = ("response_format", "structured_outputs", *GUIDED)


def structured_outputs(b: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, or None; 400 naming the field when it is malformed, when
    several are given, or when it cannot be enforced."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = b.get("response_format")
    if rf is not None:
        so = _response_format(rf)
        if so is not None:
            found.append(("response_format", so))
    if b.get("structured_outputs") is not None:
        found.append(("structured_outputs", _vllm(b["structured_outputs"])))
    for name, kind in GUIDED.items():
        if b.get(name) is not None:
            found.append((name, _make(name, {kind: b[name]})))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for n, _ in found)
        raise bad_request(
            f"give one output constraint, got {names}", found[1][0], "invalid_request_error"
        )
    if not found:
        return None
    param, so = found[0]
    check_constraint(param, so)
    return so


def check_constraint(param: str, so: StructuredOutputsParams) -> None:
    """400 naming ``param`` when llguidance cannot compile the constraint."""
    error = _compile_error(*so.key())
    if error:
        raise bad_request(f"'{param}' cannot be enforced: {error}", param)


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {show(rf)}',
            "response_format",
        )
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "'response_format.json_schema' must be an object with 'name' and 'schema'",
            "response_format.json_schema",
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(
            f"'response_format.json_schema.name' must be a string, got {show(name)}",
            "response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            f"'response_format.json_schema.strict' must be true or false, got {show(strict)}",
            "response_format.json_schema.strict",
        )
    # Without a schema OpenAI accepts any JSON; strict or not, the schema is enforced here.
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(
            f"'response_format.json_schema.schema' must be a JSON schema object, got "
            f"{show(schema)}",
            "response_format.json_schema.schema",
        )
    return _make("response_format.json_schema.schema", {"json": schema})


def _vllm(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request(
            f"'structured_outputs' must be an object with one of {', '.join(KINDS)}",
            "structured_outputs",
        )
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise bad_request(
            f"'structured_outputs' keys {unknown} are not supported; use one of {', '.join(KINDS)}",
            f"structured_outputs.{unknown[0]}",
            "unsupported_parameter",
        )
    return _make("structured_outputs", value)


def _make(param: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise bad_request(f"'{param}': {e}", param) from None


@functools.lru_cache(maxsize=512)
def _compile_error(kind: str, spec: str) -> str:
    # Imported here: the body decoder's process imports this module for FIELDS alone, and
    # the grammar engine brings torch (seconds, hundreds of MB) with it.
    from hetero_pd.engine.structured import GrammarError, check_grammar

    try:
        check_grammar(StructuredOutputsParams.from_key(kind, spec))
    except GrammarError as e:
        return str(e)
    return ""
