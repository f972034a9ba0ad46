"""Structured outputs and tool calls through served stacks (1P1D and one colocated worker),
with the official openai client.

On the default model (the shared stacks): a constraint holds across the prefill -> decode
hand-off (the prefill worker samples the first token under it, the decode worker resumes
the grammar), with the single-process engine's greedy text, for prompts prefilled on the
decode worker and on the prefill worker alike, and a JSON object ends where the model
closes it; under "auto" a call the model writes by itself is read back as a call.

On the tiny text model with the default model's tokenizer and chat template (prompts
render to the same tokens; what is asserted holds by the grammar, whatever the weights):
a constraint the server cannot enforce is a 400; ``parse()`` with a pydantic model answers
20 varied prompts with schema-valid objects, regex and choice hold from the first token,
``tool_choice`` "required" and a named function always yield a call whose arguments
validate against the function's schema, streamed calls arrive piece by piece (id and name,
then fragments of the arguments) and reassemble to the non-streamed one; "none" answers in
text, and a conversation carrying calls and tool results back is accepted."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import jsonschema
import openai
import pydantic
import pytest

from hetero_pd import LLM, SamplingParams, StructuredOutputsParams
from hetero_pd.deploy.testing import Stack, deployment, running_stack

pytestmark = pytest.mark.slow
DECISIONS = "hetero_pd_policy_decisions_total"
#: Longer than router.local_prefill_max_tokens (32): the prefill worker computes these.
PAD = "Here is some context about the people of the town and their homes. " * 4
PROMPTS = ["A person as JSON:", PAD + "A person as JSON:"]
OBJECT_PROMPT = 'JSON: {"a": 1}\nJSON:'
OBJECT: dict[str, Any] = {"response_format": {"type": "json_object"}}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
#: Longer than router.local_prefill_max_tokens (32 tokens): prefilled on the prefill worker.
LONG_ASK = [{"role": "user", "content": "I am planning a trip. " * 6 + ASK[0]["content"]}]


class Pet(pydantic.BaseModel):
    """What parse() asks for: a short string, an enum, a bounded integer and a boolean, so
    that the grammar ends every answer within a few dozen tokens."""

    name: str = pydantic.Field(max_length=12)
    species: Literal["cat", "dog", "bird", "fish", "horse", "rabbit"]
    age: int = pydantic.Field(ge=0, le=40)
    indoor: bool


#: Pets to describe, and prompts with nothing to do with pets, in several languages; the
#: PAD ones are prefilled on the prefill worker of the 1P1D stack.
PET_PROMPTS = [
    "Invent a pet.",
    "Describe a dog called Rex who is 3 years old and lives indoors.",
    "My cat Luna is 12 and never goes outside.",
    "A parrot named Kiwi, age 40, kept in a cage in the kitchen.",
    "Tell me about a goldfish.",
    "Un chien qui s'appelle Max, cinq ans, vit dehors.",
    "Ein Kaninchen namens Hoppel, zwei Jahre alt.",
    "Horse: Thunder, 15 years, stable outside.",
    "json please",
    "What is the capital of France?",
    "Write a poem about the sea.",
    "1 2 3 4 5",
    "The oldest rabbit in the world.",
    "A pet with a long name: Sir Fluffington the Third of Bakersfield.",
    "A newborn puppy, -1 years old.",
    "Give me an animal that swims.",
    PAD + "A pet for the people of the town.",
    PAD + "My neighbour's bird sings every morning.",
    PAD + "Which pet would suit a small flat?",
    PAD + "Summarise the context above.",
]
#: Earlier turns in which the model called get_weather (as Hermes' format renders it): asked
#: again, the default model writes a call of its own, greedy and unconstrained.
PARIS = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
ASK_AGAIN: list[Any] = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [PARIS]},
    {"role": "user", "content": "What is the weather like in London today?"},
]
T = TypeVar("T")
R = TypeVar("R")


def side_by_side(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` of each item, the requests in flight together (the engine batches them)."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stack(default_pd_stack: Stack) -> Stack:
    return default_pd_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return _client(stack)


SHARED = {"1P1D": "default_pd_stack", "colocated": "default_colocated_stack"}


@pytest.fixture(scope="module", params=list(SHARED))
def real_stack(request: pytest.FixtureRequest) -> Stack:
    """Each shared stack of the default model in turn: 1P1D, then one colocated worker."""
    stack: Stack = request.getfixturevalue(SHARED[request.param])
    return stack


@pytest.fixture(scope="module")
def tiny_pd(text_chat_dir: Path) -> Iterator[Stack]:
    with running_stack(deployment(text_chat_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_colocated(text_chat_dir: Path) -> Iterator[Stack]:
    with running_stack(deployment(text_chat_dir, workers=[{"role": "both"}])) as s:
        yield s


TINY = {"1P1D": "tiny_pd", "colocated": "tiny_colocated"}


@pytest.fixture(scope="module", params=list(TINY))
def any_stack(request: pytest.FixtureRequest) -> Stack:
    """Each stack of the tiny text model in turn: 1P1D, then one colocated worker."""
    stack: Stack = request.getfixturevalue(TINY[request.param])
    return stack


def test_json_schema_across_the_handoff_equals_the_engine(
    stack: Stack, client: openai.OpenAI, default_model_dir: Path
) -> None:
    as_json = StructuredOutputsParams(json=SCHEMA)
    cases = [
        *((p, as_json, {"guided_json": SCHEMA}) for p in PROMPTS),
        # bounded by nothing but the object's end: the model closes it, the grammar ends there
        (OBJECT_PROMPT, StructuredOutputsParams(json_object=True), OBJECT),
    ]
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
              for _, so, _ in cases]  # fmt: skip
    expected = [o.outputs[0].text for o in llm.generate([p for p, _, _ in cases], params)]
    del llm
    before = stack.metric(DECISIONS, decision="disaggregated")
    served = [
        client.completions.create(
            model=stack.dep.model, prompt=p, max_tokens=48, temperature=0, extra_body=extra,
        ).choices[0]
        for p, _, extra in cases
    ]  # fmt: skip
    assert [c.text for c in served] == expected
    for c in served:
        assert c.finish_reason == "stop"
    for c in served[:2]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert isinstance(json.loads(served[2].text), dict)
    assert stack.metric(DECISIONS, decision="disaggregated") == before + 1


def test_parse_with_a_pydantic_model_and_streamed_json_schema(any_stack: Stack) -> None:
    # strict, as parse() sends it: no properties but Pet's
    client, schema = _client(any_stack), {**Pet.model_json_schema(), "additionalProperties": False}

    def parse(content: str) -> Any:
        return client.chat.completions.parse(
            model=any_stack.dep.model, messages=[{"role": "user", "content": content}],
            response_format=Pet, max_tokens=48, temperature=0,
        ).choices[0]  # fmt: skip

    for choice in side_by_side(parse, PET_PROMPTS):
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(
        model=any_stack.dep.model, messages=[{"role": "user", "content": PAD + "A person:"}],
        max_tokens=48, temperature=0.8, seed=5, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "pet", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_hold_from_the_first_token(any_stack: Stack) -> None:
    """Choices the model would never start with unconstrained: the first token, sampled on
    the prefill worker for the long prompt on 1P1D, is already under the constraint."""
    client, choices, pattern = (
        _client(any_stack),
        ["zebra crossing", "yak butter"],
        r"[0-9]{3}-[A-Z]{2}",
    )
    cases = [
        (prompt, extra, n)
        for prompt in ("Hello", PAD + "Hello")
        for extra in ({"guided_choice": choices}, {"guided_regex": pattern})
        for n in (1, 2)
    ]

    def complete(case: tuple[str, dict[str, Any], int]) -> Any:
        prompt, extra, n = case
        return client.completions.create(
            model=any_stack.dep.model, prompt=prompt, max_tokens=12, n=n, temperature=1.0,
            seed=3, extra_body=extra,
        )  # fmt: skip

    for (_, extra, n), r in zip(cases, side_by_side(complete, cases), strict=True):
        assert len(r.choices) == n
        for c in r.choices:
            ok = c.text in choices if "guided_choice" in extra else re.fullmatch(pattern, c.text)
            assert ok, (extra, c.text)
            assert c.finish_reason == "stop"


def test_constraints_the_server_cannot_enforce_are_400s(tiny_pd: Stack) -> None:
    stack, client = tiny_pd, _client(tiny_pd)
    for extra, words in (
        ({"guided_regex": "(a)\\1"}, "guided_regex"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "schema"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(
                model=stack.dep.model, prompt="x", max_tokens=4, extra_body=extra
            )
    r = client.completions.create(
        model=stack.dep.model, prompt="x", max_tokens=4, extra_body={"guided_choice": ["ok"]}
    )
    assert r.choices[0].text == "ok"
    stack.wait_idle()


def _valid_calls(choice: Any, names: set[str]) -> list[Any]:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_required_and_named_always_call_with_valid_arguments(any_stack: Stack) -> None:
    client = _client(any_stack)
    named = {"type": "function", "function": {"name": "get_time"}}
    cases: list[tuple[list[Any], Any, float]] = [
        (ASK, "required", 0.0), (LONG_ASK, "required", 1.0), (LONG_ASK, named, 0.0)
    ]  # fmt: skip

    def ask(case: tuple[list[Any], Any, float]) -> Any:
        messages, tool_choice, temperature = case
        return client.chat.completions.create(
            model=any_stack.dep.model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=80, temperature=temperature, seed=1, parallel_tool_calls=False,
        ).choices[0]  # fmt: skip

    required, long_required, by_name = side_by_side(ask, cases)
    assert len(_valid_calls(required, set(SCHEMAS))) == 1
    assert len(_valid_calls(long_required, set(SCHEMAS))) == 1
    assert [c.function.name for c in _valid_calls(by_name, {"get_time"})] == ["get_time"]


def test_streamed_calls_reassemble_to_the_whole_call(any_stack: Stack) -> None:
    client = _client(any_stack)
    kw: dict[str, Any] = dict(
        model=any_stack.dep.model, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=80, temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    whole = _valid_calls(client.chat.completions.create(**kw).choices[0], set(SCHEMAS))
    calls: dict[int, dict[str, str]] = {}
    fragments, finish = 0, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            assert d.function is not None
            if d.index not in calls:  # OpenAI's first delta of a call: its id and name
                assert d.id is not None and d.id.startswith("call_") and d.type == "function"
                calls[d.index] = {"name": d.function.name or "", "arguments": ""}
            else:  # then fragments of the arguments only
                assert d.id is None and d.function.name is None and d.function.arguments
                fragments += 1
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert fragments > 1, "the arguments came whole, not as the tokens arrived"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


def test_auto_reads_the_call_the_model_writes(real_stack: Stack) -> None:
    """No grammar under "auto": the model writes `<tool_call>` JSON by itself, greedy, and
    the answer's text is read into a call (a broken reader leaves it text, finish "stop")."""
    kw: dict[str, Any] = dict(
        model=real_stack.dep.model, messages=ASK_AGAIN, tools=TOOLS, tool_choice="auto",
        max_tokens=60, temperature=0,
    )  # fmt: skip
    choice = _client(real_stack).chat.completions.create(**kw).choices[0]
    calls = _valid_calls(choice, set(SCHEMAS))
    assert [c.function.name for c in calls] == ["get_weather"] and choice.message.content is None
    real_stack.wait_idle()


def test_none_answers_in_text_and_tool_results_go_back(tiny_pd: Stack) -> None:
    stack, client = tiny_pd, _client(tiny_pd)
    r = client.chat.completions.create(
        model=stack.dep.model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    followup: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=stack.dep.model, messages=followup, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model=stack.dep.model, messages=ASK, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    stack.wait_idle()
