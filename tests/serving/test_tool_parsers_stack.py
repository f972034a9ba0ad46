"""A deployment with ``router.tool_call_parser: llama3_json`` and
``enable_auto_tool_choice: false`` (vLLM's --tool-call-parser and its default without
--enable-auto-tool-choice), served 1P1D with the official openai client: a forced call is
written in Llama 3's format (bare JSON) and read back as a call whose arguments validate,
whole and streamed alike; ``auto`` is a 400 naming ``tool_choice``. On the tiny text model
with the default model's tokenizer and chat template: the grammar writes the call, whatever
the weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from hetero_pd.deploy.testing import Stack, deployment, running_stack

pytestmark = pytest.mark.slow
#: Bounded numbers: the call ends within max_tokens whatever the (random) weights pick.
NUMBER = {"type": "integer", "minimum": 0, "maximum": 999}
ADD = {"type": "object", "properties": {"a": NUMBER, "b": NUMBER},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS: list[Any] = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
ASK: list[Any] = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]


@pytest.fixture(scope="module")
def stack(text_chat_dir: Path) -> Iterator[Stack]:
    router = {"tool_call_parser": "llama3_json", "enable_auto_tool_choice": False}
    with running_stack(deployment(text_chat_dir, router=router)) as s:
        yield s


def streamed_call(client: openai.OpenAI, kw: dict[str, Any]) -> str:
    """The arguments of the one call of the streamed answer to `kw`, reassembled from its
    deltas; the answer must end for tool calls."""
    streamed, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0 and d.function is not None
            streamed += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    return streamed


def test_llama3_json_calls_whole_and_streamed_and_auto_refused(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(
        model=stack.dep.model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["add"]  # type: ignore[union-attr]
    arguments = calls[0].function.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), ADD)
    assert streamed_call(client, kw) == arguments
    with pytest.raises(openai.BadRequestError, match="enable_auto_tool_choice") as info:
        client.chat.completions.create(**{**kw, "tool_choice": "auto"})
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    stack.wait_idle()
