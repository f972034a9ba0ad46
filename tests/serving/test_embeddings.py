"""/v1/embeddings through served 1P1D and colocated stacks of the default model, with the
official openai client: each vector is the last token's final hidden state, L2-normalised, equal to
transformers' within float32 rounding, for text, text lists and token ids, as floats and
as base64; the same input gives the same vector across calls and batch sizes; usage counts
the prompt tokens; bad input is a 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from hetero_pd.deploy.testing import Stack

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "a", "Embeddings turn text into vectors."]


@pytest.fixture(scope="module")
def stack(default_pd_stack: Stack) -> Stack:
    return default_pd_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> tuple[Any, list[list[int]], np.ndarray]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = [tok.encode(t) for t in TEXTS]
    rows = []
    with torch.no_grad():
        for seq in ids:
            last = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0, -1]
            rows.append(torch.nn.functional.normalize(last, dim=-1).numpy())
    return tok, ids, np.stack(rows)


def _vectors(r: Any) -> np.ndarray:
    assert [d.index for d in r.data] == list(range(len(r.data)))
    return np.array([d.embedding for d in r.data], dtype=np.float32)


def test_vectors_equal_transformers_for_every_input_shape(
    stack: Stack, client: openai.OpenAI, reference: tuple[Any, list[list[int]], np.ndarray]
) -> None:
    _, ids, expected = reference
    model = stack.dep.model
    whole = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert whole.object == "list" and whole.model == model
    assert whole.usage.prompt_tokens == whole.usage.total_tokens == sum(map(len, ids))
    np.testing.assert_allclose(_vectors(whole), expected, atol=1e-4)
    # The client's default: base64, which it decodes to floats.
    as_ids = client.embeddings.create(model=model, input=ids)
    np.testing.assert_allclose(_vectors(as_ids), expected, atol=1e-4)
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(_vectors(one)[0], expected[0], atol=1e-4)
    # The same input: the same vector, whatever else the batch holds.
    for i, text in enumerate(TEXTS):
        alone = _vectors(client.embeddings.create(model=model, input=text))[0]
        np.testing.assert_allclose(alone, _vectors(whole)[i], atol=1e-5)
    stack.wait_idle()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": ""}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": [[1, -1]]}, "input[0]"),
        ({"input": ["a", [1]]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 7}, "dimensions"),
        ({"input": "a", "dimensions": "big"}, "dimensions"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    stack: Stack, client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/embeddings", body={"model": stack.dep.model, **extra}, cast_to=object)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_a_colocated_worker_embeds_too(
    default_colocated_stack: Stack, reference: tuple[Any, list[list[int]], np.ndarray]
) -> None:
    _, ids, expected = reference
    s = default_colocated_stack
    client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120)
    r = client.embeddings.create(model=s.dep.model, input=ids[:2])
    np.testing.assert_allclose(_vectors(r), expected[:2], atol=1e-4)
    s.wait_idle()
