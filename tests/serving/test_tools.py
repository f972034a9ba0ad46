"""Tool calling without a stack: the Hermes parser on canned answers, whole and streamed
(any cut of the text into deltas reassembles to the whole answer's calls), the checks on
``tools`` / ``tool_choice`` (400s naming the field), and the grammar of a forced call, which
accepts a valid call token by token on the default model's vocabulary and nothing else."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.engine.structured import GrammarCompiler
from hetero_pd.serving.api.errors import APIError
from hetero_pd.serving.api.protocol import parse_chat_request, parse_completion_request
from hetero_pd.serving.api.tool_stream import PARSERS, parse_tool_calls
from hetero_pd.serving.api.tools import ToolSettings
from hetero_pd.structured_outputs import StructuredOutputsParams

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]  # fmt: skip


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "2+3?"}], **fields}


def _stream(
    text: str, cuts: list[int], parser: str = "hermes"
) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """``text`` fed in the pieces ``cuts`` makes: (content, reassembled calls, deltas)."""
    reader, content, deltas = PARSERS[parser](), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece, got = reader.feed(text[a:b])
        content += piece
        deltas += got
    content += reader.finish()
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.id is not None:  # a call's first delta: id and name, before any argument
            assert d.index not in calls and d.arguments == ""
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)], deltas


STREAMED = [
    'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": {"c": "}\\""}}}'
    '\n</tool_call>\n<tool_call>{"arguments": {}, "name": "now"}</tool_call>'
    "<tool_call>{not json}</tool_call>",
    '<tool_call>\n{"name": "now"}\n</tool_call>',
    "just text, with a < and a <tool_",
    "text and <tool_call>{broken",
]


LLAMA3 = (
    '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; '
    '{"name": "now", "parameters": {}}'
)
MISTRAL = (
    'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, '
    '{"name": "now", "arguments": {}}]'
)
TWO = [("add", {"a": 2, "b": 3}), ("now", {})]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", STREAMED[0], "Let me compute.", [("add", {"a": 2, "b": {"c": '}"'}}), TWO[1]]),
        ("hermes", STREAMED[1], None, [("now", {})]),
        ("hermes", STREAMED[2], STREAMED[2], []),
        ("hermes", STREAMED[3], STREAMED[3], []),
        ("llama3_json", LLAMA3, None, TWO),
        ("llama3_json", LLAMA3.removeprefix("<|python_tag|>"), None, TWO),
        ("llama3_json", 'It is {"name": "add"}', 'It is {"name": "add"}', []),
        ("mistral", MISTRAL, "Sure.", TWO),
        ("mistral", "No call [TOOL_", "No call [TOOL_", []),
    ],
)
def test_streamed_calls_reassemble_to_the_whole_answer_whatever_the_cuts(
    parser: str, text: str, content: str | None, calls: list[Any]
) -> None:
    got_content, got = parse_tool_calls(text, parser)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        (name, args) for name, args in calls
    ]
    assert len({c["id"] for c in got}) == len(got) and all(c["type"] == "function" for c in got)
    whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in got]  # fmt: skip
    for step in (1, 2, 3, 7, len(text)):
        streamed_content, streamed, _ = _stream(text, list(range(step, len(text), step)), parser)
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed] == whole
        assert streamed_content.strip() == (content or "").strip(), step


def test_a_call_streams_its_name_first_then_argument_fragments() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 3}}\n</tool_call>'
    cuts = [text.index('"add"') + 3, text.index("12") + 1, text.index("3}") + 1, len(text) - 4]
    content, calls, deltas = _stream(text, cuts)
    assert content == "" and [d.to_json() for d in deltas][1:] == [
        {"index": 0, "function": {"arguments": '{"a": 1'}},
        {"index": 0, "function": {"arguments": '2, "b": 3'}},
        {"index": 0, "function": {"arguments": "}"}},
    ]
    first = deltas[0].to_json()
    assert first == {"index": 0, "id": calls[0]["id"], "type": "function",
                     "function": {"name": "add", "arguments": ""}}  # fmt: skip
    assert json.loads(calls[0]["arguments"]) == {"a": 12, "b": 3}


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


def _accepts(default_model_dir: Path) -> Callable[[StructuredOutputsParams, str], bool]:
    """Whether a constraint's grammar takes the whole of a text, token by token, on the
    default model's vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    compiler = GrammarCompiler(default_model_dir, tok.get_vocab_size(), [2])

    def accepts(constraint: StructuredOutputsParams, text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False).ids
        return bool(compiler.matcher(constraint).llmatcher.validate_tokens(ids) == len(ids))

    return accepts


@pytest.mark.slow
def test_a_forced_call_accepts_valid_calls_only(default_model_dir: Path) -> None:
    accepts = _accepts(default_model_dir)
    named = parse_chat_request(chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}})).params.structured_outputs  # fmt: skip
    required = parse_chat_request(chat(tools=TOOLS, tool_choice="required"))
    so = required.params.structured_outputs
    assert named is not None and so is not None
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": "2"}}\n</tool_call>'
    for constraint, text, ok in ((named, good, True), (so, good, True), (named, bad, False),
                                 (named, good.replace("add", "now"), False)):  # fmt: skip
        assert accepts(constraint, text) is ok, text


@pytest.mark.slow
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_forced_calls_json_is_as_compact_as_a_json_schemas(
    default_model_dir: Path, parser: str
) -> None:
    """Whitespace only where a json_schema answer has it (": " and ", "): with JSON's free
    whitespace a model can write newlines inside a call until max_tokens (a random one
    did, greedy: '<tool_call>\n{\r\r\r...' and no call)."""
    accepts = _accepts(default_model_dir)
    body = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    loose = [body.replace(a, b) for a, b in (
        ("{", "{\r"), ("{", "{ "), (": ", ":"), (", ", " , "), ("}}", "}\n}"))]  # fmt: skip
    around = ("<tool_call>\n", "\n</tool_call>") if parser == "hermes" else ("", "")
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        request = parse_chat_request(chat(tools=TOOLS, tool_choice=choice), ToolSettings(parser))
        so = request.params.structured_outputs
        assert so is not None and accepts(so, body.join(around)), (choice, parser)
        for text in loose:
            assert not accepts(so, text.join(around)), (choice, parser, text)


def test_serve_flags_choose_the_parser_and_auto(default_model_dir: Path) -> None:
    from hetero_pd.deploy.model_deployment import deployment_for_model
    from hetero_pd.deploy.sections import TOOL_CALL_PARSERS
    from hetero_pd.deploy.serve import build_parser

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    model, parser = str(default_model_dir), build_parser()
    flags = ["--tool-call-parser", "llama3_json", "--no-enable-auto-tool-choice"]
    router = deployment_for_model(model, parser.parse_args([model, *flags])).router
    assert (router.tool_call_parser, router.enable_auto_tool_choice) == ("llama3_json", False)
    router = deployment_for_model(model, parser.parse_args([model])).router
    assert (router.tool_call_parser, router.enable_auto_tool_choice) == ("hermes", True)
    with pytest.raises(SystemExit):
        parser.parse_args([model, "--tool-call-parser", "pythonic"])
