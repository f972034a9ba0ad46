"""One short check on the real default model (SmolLM2-135M): the edge's hidden states after
layer 4 match the full model's, int8 stays close despite its massive activations, and chat
prompts tokenize as the router's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from edge import EdgeRuntime
from edge.codec import measure

pytestmark = pytest.mark.slow
Reference = Callable[[Path, Sequence[int], Sequence[int], int], torch.Tensor]


def test_default_model_edge_layers(default_model_dir: Path, reference: Reference) -> None:
    rt = EdgeRuntime(default_model_dir, 4, max_positions=256)
    ids = rt.tokenize("What is the capital of France? Answer in one sentence.")
    got = torch.cat([rt.prefill(ids[:-2]), rt.step(ids[-2]), rt.step(ids[-1])])
    want = reference(default_model_dir, ids[:-2], ids[-2:], 4)
    assert float(want.abs().max()) > 100  # the massive activations are there
    # float32 rounding only: relative to values in the hundreds.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert measure(got, "float16").min_cosine > 0.999999
    int8 = measure(got, "int8")
    assert int8.min_cosine > 0.9999
    assert measure(got, "int8", outliers=0).min_cosine < int8.min_cosine
    # Chat prompts tokenize as the router's chat API does (template, no extra specials).
    chat = rt.tokenize_chat([{"role": "user", "content": "Hi"}])
    text = rt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == rt.tokenizer.encode(str(text), add_special_tokens=False)
