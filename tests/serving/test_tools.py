"""Tool calling without a stack: the Hermes parser on canned answers, the checks on
``tools`` / ``tool_choice`` (400s naming the field), and the grammar of a forced call, which
accepts a valid call token by token on the default model's vocabulary and nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.engine.structured import GrammarCompiler
from hetero_pd.serving.api.errors import APIError
from hetero_pd.serving.api.protocol import parse_chat_request, parse_completion_request
from hetero_pd.serving.api.tools import parse_tool_calls

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]  # fmt: skip


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "2+3?"}], **fields}


def test_hermes_calls_are_parsed_from_a_canned_answer() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2, "b": 3}),
        ("now", {}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert parse_tool_calls("no call here") == ("no call here", [])


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0]", '"type": "function"'),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
         "letters"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "one of ['add', 'now']"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
         "constrains the output already"),
        ({"tools": [{"type": "function", "function": {"name": "u", "parameters": {
            "type": "array", "uniqueItems": True}}}], "tool_choice": "required"}, "tools",
         "uniqueItems"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(fields: dict[str, Any], param: str, words: str):
    with pytest.raises(APIError) as info:
        parse_chat_request(chat(**fields))
    assert info.value.param == param and words in info.value.message, info.value.message


def test_tools_are_for_chat_and_none_means_no_tools() -> None:
    with pytest.raises(APIError, match="chat/completions"):
        parse_completion_request({"model": "m", "prompt": "x", "tools": TOOLS})
    assert parse_chat_request(chat(tools=TOOLS, tool_choice="none")).tools is None
    auto = parse_chat_request(chat(tools=TOOLS))
    assert auto.tools is not None and auto.params.structured_outputs is None


@pytest.mark.slow
def test_a_forced_call_accepts_valid_calls_only(default_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    compiler = GrammarCompiler(default_model_dir, tok.get_vocab_size(), [2])
    named = parse_chat_request(chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}})).params.structured_outputs  # fmt: skip
    required = parse_chat_request(chat(tools=TOOLS, tool_choice="required"))
    so = required.params.structured_outputs
    assert named is not None and so is not None
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": "2"}}\n</tool_call>'
    for constraint, text, ok in ((named, good, True), (so, good, True), (named, bad, False),
                                 (named, good.replace("add", "now"), False)):  # fmt: skip
        m = compiler.matcher(constraint)
        ids = tok.encode(text, add_special_tokens=False).ids
        accepted = m.llmatcher.validate_tokens(ids)
        assert (accepted == len(ids)) is ok, text
