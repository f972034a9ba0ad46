"""``router.tool_call_parser: mistral`` served (1P1D) on a tiny random Mistral whose
tokenizer has ``[TOOL_CALLS]`` as one special token, as Mistral's own have (built offline:
the default model's tokenizer with that token added), through the official openai client:
a forced call starts with that special token, not with its spelling in text tokens, and is
read back into ``tool_calls`` whose arguments validate, whole and streamed alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from hetero_pd.deploy.testing import Stack, deployment, running_stack

from .test_tool_parsers_stack import streamed_call

pytestmark = pytest.mark.slow

MARKER = "[TOOL_CALLS]"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "time", "parameters": CITY}},
]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    dest = tmp_path_factory.mktemp("tiny-mistral-tools")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": [MARKER]})
    tok.save_pretrained(dest)
    config = MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        sliding_window=None, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(6)
    MistralForCausalLM(config).eval().save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def stack(mistral_dir: Path) -> Iterator[Stack]:
    with running_stack(deployment(mistral_dir, router={"tool_call_parser": "mistral"})) as s:
        yield s


def test_a_forced_mistral_call_starts_with_the_special_token(
    stack: Stack, mistral_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mistral_dir)
    marker_id = tok.convert_tokens_to_ids(MARKER)
    # The grammar lets JSON have whitespace anywhere; random weights would fill max_tokens
    # with it (a trained model does not), so whitespace-only tokens are biased away.
    blank = {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(
        model=stack.dep.model, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "weather"}}, logit_bias=blank,
    )  # fmt: skip
    choice = client.chat.completions.create(logprobs=True, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["weather"]  # type: ignore[union-attr]
    arguments = calls[0].function.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), CITY)
    assert choice.logprobs is not None and choice.logprobs.content
    assert choice.logprobs.content[0].token == MARKER  # one token, not "[", "TOOL", ...
    assert marker_id >= 49152  # the token added to the default model's vocabulary
    assert streamed_call(client, kw) == arguments
    stack.wait_idle()
