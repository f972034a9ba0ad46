"""Structured outputs through a served 1P1D stack of the default model, with the official
openai client: a constraint holds across the prefill -> decode hand-off (the prefill worker
samples the first token under it, the decode worker resumes the grammar), with the
single-process engine's greedy text, for prompts prefilled on the decode worker and on the
prefill worker alike; a constraint the server cannot enforce is a 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

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
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def stack(default_model_dir: Path) -> Iterator[Stack]:
    with running_stack(deployment(default_model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)


def test_json_schema_across_the_handoff_equals_the_engine(
    stack: Stack, client: openai.OpenAI, default_model_dir: Path
) -> None:
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    del llm
    before = stack.metric(DECISIONS, decision="disaggregated")
    served = [
        client.completions.create(
            model=stack.dep.model, prompt=p, max_tokens=40, temperature=0,
            extra_body={"guided_json": SCHEMA},
        ).choices[0]
        for p in PROMPTS
    ]  # fmt: skip
    assert [c.text for c in served] == expected
    for c in served:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert stack.metric(DECISIONS, decision="disaggregated") == before + 1


def test_parse_with_a_pydantic_model_and_streamed_json_schema(
    stack: Stack, client: openai.OpenAI
) -> None:
    for content in ("Invent a person.", PAD + "Invent a person."):
        done = client.chat.completions.parse(
            model=stack.dep.model, messages=[{"role": "user", "content": content}],
            response_format=Person, max_tokens=40, temperature=0,
        )  # fmt: skip
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Person), done.choices[0].message.content
    stream = client.chat.completions.create(
        model=stack.dep.model, messages=[{"role": "user", "content": PAD + "A person:"}],
        max_tokens=40, temperature=0.8, seed=5, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_hold_from_the_first_token(stack: Stack, client: openai.OpenAI) -> None:
    """Choices the model would never start with unconstrained: the first token, sampled on
    the prefill worker for the long prompt, is already under the constraint."""
    choices = ["zebra crossing", "yak butter"]
    for prompt in ("Hello", PAD + "Hello"):
        for extra, check in (
            ({"guided_choice": choices}, lambda t: t in choices),
            (
                {"guided_regex": r"[0-9]{3}-[A-Z]{2}"},
                lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t),
            ),
        ):
            for n in (1, 2):
                r = client.completions.create(
                    model=stack.dep.model, prompt=prompt, max_tokens=12, n=n, temperature=1.0,
                    seed=3, extra_body=extra,
                )  # fmt: skip
                for c in r.choices:
                    assert check(c.text), (extra, c.text)
                    assert c.finish_reason == "stop"


def test_constraints_the_server_cannot_enforce_are_400s(
    stack: Stack, client: openai.OpenAI
) -> None:
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
