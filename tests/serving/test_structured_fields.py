"""The API's structured-output fields (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*``) become one ``StructuredOutputsParams``; what is
malformed, doubled or not enforceable is a 400 that names the field and says why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hetero_pd import StructuredOutputsParams
from hetero_pd.serving.api.bodies import decode_body
from hetero_pd.serving.api.errors import APIError
from hetero_pd.serving.api.protocol import parse_chat_request, parse_completion_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def constraint(**fields: Any) -> StructuredOutputsParams | None:
    """What both endpoints make of the fields, decoded as the server decodes a body."""
    got = []
    for kind, parse, body in (
        ("chat", parse_chat_request, chat),
        ("completion", parse_completion_request, completion),
    ):
        raw = json.dumps(body(**fields)).encode()
        got.append(parse(decode_body(raw, kind, 4096)).params.structured_outputs)  # type: ignore[arg-type]
    assert got[0] == got[1]
    return got[0]


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        constraint(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}},
         StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"+'}, StructuredOutputsParams(grammar='root ::= "a"+')),
    ],
)  # fmt: skip
def test_each_shape_becomes_one_constraint(
    fields: dict[str, Any], expected: StructuredOutputsParams | None
) -> None:
    assert constraint(**fields) == expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
         "response_format.json_schema.schema", "schema object"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
         "response_format", "uniqueItems"),
        ({"guided_regex": "(?=a)a"}, "guided_regex", "cannot be enforced"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
        ({"guided_choice": []}, "guided_choice", "list of 1 to"),
        ({"guided_choice": "yes"}, "guided_choice", "list of 1 to"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
         "not supported"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "give one output constraint"),
        ({"guided_regex": "a" * 70_000}, "guided_regex", "more than any value"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    err = refused(**fields)
    assert err.param == param, err.message
    assert words in err.message, err.message
