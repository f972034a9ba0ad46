"""Draft models for `draft_model` speculation built offline from a target model folder:
its first N decoder layers with its final norm and lm_head (an early exit, as LayerSkip
drafts), or a small random-weight model of its vocabulary (proposals nearly always wrong:
the worst case). Both keep the target's tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

#: Files of a model folder that are its tokenizer and chat template, not its weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def _copy_tokenizer(src: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)


def save_early_exit(src: Path, dest: Path, num_layers: int) -> Path:
    """`src`'s first `num_layers` decoder layers, its final norm and lm_head, saved with
    save_pretrained into `dest` (real weights: the layers' output read early)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"an early-exit draft keeps 1 to {total - 1} layers, not {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    _copy_tokenizer(src, dest)
    return dest


def save_random_draft(src: Path, dest: Path, seed: int = 0) -> Path:
    """A two-layer Llama with random weights and `src`'s vocabulary and tokenizer (its
    own lm_head: proposals unrelated to the sequence)."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    target = AutoConfig.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=target.max_position_embeddings,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
        # untied: a tied random model's argmax tends to repeat its input token
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    dest.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).eval().save_pretrained(dest)
    _copy_tokenizer(src, dest)
    return dest
