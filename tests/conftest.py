"""Shared fixtures: the default model (fetched once by `make test`), tiny random models
written with transformers' own save_pretrained, and their transformers references."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(2)
# Engines run eager unless a test asks for `compile="on"`: compiling takes a minute or more,
# so only the tests that check the compiled step pay for it (workers inherit this too).
os.environ.setdefault("HETERO_PD_COMPILE", "off")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer_dir(default_model_dir: Path) -> Path:
    """A folder with the default model's tokenizer files."""
    return default_model_dir


def _save_tiny(config: Any, model_cls: Any, dest: Path, tokenizer_src: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, dest / name)
    return dest


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=False, rope_theta=10000.0)
    return _save_tiny(
        config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir, 1
    )


@pytest.fixture(scope="session")
def text_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Llama whose vocabulary covers the default model's tokenizer, so real
    text can be tokenized for it (edge devices tokenize themselves)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=True)
    return _save_tiny(
        config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-text-llama"), tokenizer_dir, 3
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    return _save_tiny(
        config, Qwen2ForCausalLM, tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir, 2
    )


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[int]]:
    """transformers' greedy `generate` for one prompt: the reference tokens
    (`run(path, prompt, max_new_tokens, dtype=torch.float32)`)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[Path, torch.dtype], Any] = {}

    def run(
        path: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
    ) -> list[int]:
        if (path, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            # Like ignore_eos: generate past EOS without suppressing it (min_new_tokens would
            # mask EOS out of the logits and so change the greedy choice).
            model.generation_config.eos_token_id = None
            model.config.eos_token_id = None
            cache[path, dtype] = model
        model = cache[path, dtype]
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == len(prompt) + max_new_tokens
        return out[0, len(prompt) :].tolist()

    return run
