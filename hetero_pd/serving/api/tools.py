"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` in OpenAI's shape, in the Hermes format (vLLM's ``hermes`` parser)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through the chat template when it renders ``tools``, else
through a system prompt that lists them (Qwen2.5's and Hermes' wording). ``auto``: the
answer is read for calls; ``required`` and a named function: the output is
constrained by a grammar (one or more calls whose ``arguments`` follow the function's JSON
schema), so it is always a valid call. ``none`` or no tools: a plain chat answer. The
answer's calls are read by ``hetero_pd.serving.api.tool_stream``, as the text arrives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetero_pd.serving.api.errors import bad_request
from hetero_pd.serving.api.fields import show
from hetero_pd.structured_outputs import JSON_OPTIONS, StructuredOutputsParams

#: Most tools one request may list.
MAX_TOOLS = 128
FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The deployment's tool calling (``router.tool_call_parser``, vLLM's names, and
    ``router.enable_auto_tool_choice``)."""

    parser: str = "hermes"
    auto: bool = True
    #: The id of the format's marker when the tokenizer has it as one special token
    #: (Mistral's ``[TOOL_CALLS]``): a forced call then starts with that token, as the
    #: model writes it, not with its spelling in text tokens.
    marker_id: int | None = None

    @classmethod
    def for_tokenizer(cls, parser: str, auto: bool, tokenizer: Any) -> ToolSettings:
        marker = _MARKERS.get(parser)
        if marker is None:
            return cls(parser, auto)
        added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        return cls(parser, auto, added.get(marker))


DEFAULT_TOOLS = ToolSettings()
#: Markers that tokenizers of the format's models have as one special token.
_MARKERS = {"mistral": "[TOOL_CALLS]"}
#: A forced call as each format writes it (lark): one call, or one or more.
_FORMATS = {
    "hermes": ('"<tool_call>\\n" body "\\n</tool_call>"', '"\\n"', "", ""),
    "llama3_json": ("body", '"; "', "", ""),
    "mistral": ("body", '", "', '"[TOOL_CALLS]" "[" ', ' "]"'),
}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools and how the answer may use them."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects ({"type": "function", ...}), checked
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool = True
    parser: str = "hermes"  # the format calls are written and read in (tool_stream.PARSERS)
    marker_id: int | None = None  # ToolSettings'

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call (``required`` or named): None for ``auto``."""
        if not self.forced:
            return None
        functions = [t["function"] for t in self.tools]
        if self.choice != "required":
            functions = [f for f in functions if f["name"] == self.choice]
        bodies = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        # Written as a json_schema answer is (lark's %json reads its options from the schema)
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        # A named function is called once (OpenAI's forced function); "required": one or more.
        several = self.parallel and self.choice == "required"
        call, sep, before, after = _FORMATS[self.parser]
        if self.marker_id is not None:
            before = before.replace(json.dumps(_MARKERS[self.parser]), f"<[{self.marker_id}]>")
        calls = f"call ({sep} call)*" if several else "call"
        lark = f"start: {before}{calls}{after}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"
        return StructuredOutputsParams(grammar=lark)

    def system_prompt(self) -> str:
        listed = "\n".join(json.dumps(t) for t in self.tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def with_system_prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The messages for a template that does not render tools: the tools' prompt joins
        the system message (or becomes one), tool results become Hermes' responses."""
        out = [
            {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            if m["role"] == "tool"
            else m
            for m in messages
        ]
        if out and out[0]["role"] == "system":
            return [
                {"role": "system", "content": out[0]["content"] + "\n\n" + self.system_prompt()},
                *out[1:],
            ]
        return [{"role": "system", "content": self.system_prompt()}, *out]


def parse_tools(
    b: Mapping[str, Any], chat: bool, settings: ToolSettings = DEFAULT_TOOLS
) -> ToolPlan | None:
    """The request's tool plan; None when it has no tools or ``tool_choice`` is "none"."""
    tools, choice = b.get("tools"), b.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request(f"'tool_choice' {show(choice)} needs 'tools'", "tool_choice")
        return None
    if not chat:
        raise bad_request("'tools' is for /v1/chat/completions", "tools", "unsupported_parameter")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    checked = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    parallel = b.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if (choice is None or choice == "auto") and not settings.auto:
        raise bad_request(
            'tool_choice "auto" (the default with tools) needs router.enable_auto_tool_choice '
            '(vLLM\'s --enable-auto-tool-choice); ask for "required", a named function or "none"',
            "tool_choice",
        )
    if choice is None or choice in ("auto", "required"):
        mode = choice or "auto"
    elif choice == "none":
        return None
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and choice["function"].get("name") in names
    ):
        mode = choice["function"]["name"]
    else:
        raise bad_request(
            '\'tool_choice\' must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": one of {names}}}}}, got {show(choice)}',
            "tool_choice",
        )
    return ToolPlan(checked, mode, parallel is not False, settings.parser, settings.marker_id)


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-', got "
            f"{show(name)}",
            f"{where}.function.name",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(
            f"'{where}.function.parameters' must be a JSON schema object",
            f"{where}.function.parameters",
        )
    out: dict[str, Any] = {"name": name}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    out["parameters"] = params or {"type": "object", "properties": {}}
    return {"type": "function", "function": out}
