"""Bad arguments, bad model folders and bad prompts give errors that name what was wrong."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetero_pd import LLM, SamplingParams
from hetero_pd.models.config import ModelConfig, ModelConfigError
from hetero_pd.models.fetch import fetch_model
from hetero_pd.models.loader import ModelLoadError

WEIGHTS = "model.safetensors"


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dest)
    return dest


def edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})


def load(path: Path | str, **kwargs: Any) -> LLM:
    return LLM(str(path), num_kv_blocks=16, **kwargs)


# -- which model ---------------------------------------------------------------------------


def test_nonexistent_path() -> None:
    with pytest.raises(FileNotFoundError, match="'/nonexistent' is neither a known name"):
        LLM(model="/nonexistent")


def test_unknown_model_name() -> None:
    with pytest.raises(FileNotFoundError, match=r"'llama-9000'.*smollm2-135m-instruct"):
        LLM(model="llama-9000")
    with pytest.raises(FileNotFoundError, match="unknown model name 'llama-9000'; known: smollm2"):
        fetch_model("llama-9000")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}: no config.json"):
        load(tmp_path)


def test_unsupported_architecture(model_copy: Path) -> None:
    def gpt2(cfg: dict[str, Any]) -> None:
        cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"

    edit_config(model_copy, gpt2)
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]") as e:
        load(model_copy)
    assert "LlamaForCausalLM" in str(e.value) and str(model_copy) in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("hidden_act", "gelu", "unsupported hidden_act 'gelu'"), ("mlp_bias", True, "mlp_bias")],
)
def test_unsupported_config_fields_are_named(
    model_copy: Path, key: str, value: Any, message: str
) -> None:
    """A field this model code would get wrong is refused, never run as a wrong model."""

    def edit(cfg: dict[str, Any]) -> None:
        cfg[key] = value

    edit_config(model_copy, edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        load(model_copy)


def test_config_that_is_not_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape("config.json: not valid JSON")):
        load(model_copy)


def test_config_missing_a_required_key(model_copy: Path) -> None:
    edit_config(model_copy, lambda cfg: cfg.pop("hidden_size"))
    with pytest.raises(ValueError, match="missing required key 'hidden_size'"):
        load(model_copy)


def test_folder_without_weights_or_tokenizer(model_copy: Path) -> None:
    (model_copy / WEIGHTS).unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files"):
        load(model_copy)
    shutil.copytree(model_copy, model_copy.parent / "no-tok")
    no_tok = model_copy.parent / "no-tok"
    (no_tok / "tokenizer.json").unlink()
    (no_tok / "x.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokenizer"):
        load(no_tok)


# -- weights -------------------------------------------------------------------------------


def test_truncated_safetensors(model_copy: Path) -> None:
    data = (model_copy / WEIGHTS).read_bytes()
    (model_copy / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file") as e:
        load(model_copy)
    assert str(model_copy / WEIGHTS) in str(e.value)


def test_garbage_safetensors(model_copy: Path) -> None:
    (model_copy / WEIGHTS).write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file"):
        load(model_copy)


def test_missing_tensor(model_copy: Path) -> None:
    edit_weights(model_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    message = "weights missing for 1 tensor(s), e.g. ['model.layers.1.self_attn.k_proj.weight']"
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load(model_copy)


def test_missing_norm(model_copy: Path) -> None:
    edit_weights(model_copy, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ModelLoadError, match=r"weights missing .*\['model.norm.weight'\]"):
        load(model_copy)


def test_shape_mismatch(model_copy: Path) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)

    edit_weights(model_copy, shrink)
    with pytest.raises(
        ModelLoadError,
        match=r"'model.layers.2.mlp.up_proj.weight' has shape \(96, 64\), "
        r"the config implies \(128, 64\)",
    ):
        load(model_copy)


def test_unexpected_tensor(model_copy: Path) -> None:
    edit_weights(model_copy, lambda t: t.update({"model.layers.0.adapter.weight": torch.zeros(2)}))
    message = "unexpected tensor 'model.layers.0.adapter.weight'"
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load(model_copy)


# -- engine options ------------------------------------------------------------------------


def test_unknown_keyword_is_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['max_num_seq'\]"):
        LLM(str(tiny_llama_dir), max_num_seq=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int8"}, r"dtype must be one of .*got 'int8'"),
        ({"dtype": torch.int8}, r"dtype must be one of .*torch\.int8"),
        ({"role": "router"}, r"role must be one of .*got 'router'"),
        ({"block_size": 0}, "block_size must be > 0, got 0"),
        ({"num_kv_blocks": -1}, "num_kv_blocks must be > 0 or None, got -1"),
        ({"max_model_len": 100_000}, r"max_model_len=100000 exceeds .* supports \(1024\)"),
        ({"device": "tpu"}, "'tpu'"),
    ],
)
def test_bad_engine_options(tiny_llama_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        LLM(str(tiny_llama_dir), **kwargs)


# -- prompts -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=64)


def assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.check_integrity()


PARAMS = SamplingParams(max_tokens=2)


def test_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(
        ValueError, match=r"token ids \[512\] are outside the vocabulary \[0, 512\)"
    ):
        llm.generate([[1, 2, 512]], PARAMS)
    with pytest.raises(ValueError, match=r"token ids \[-1\] are outside"):
        llm.generate([-1, 5], PARAMS)
    assert_clean(llm)


def test_prompt_of_the_wrong_type(llm: LLM) -> None:
    with pytest.raises(TypeError, match="a string or a list of integer token ids"):
        llm.generate([[1, 2.5]], PARAMS)  # type: ignore[list-item]
    assert_clean(llm)


def test_prompt_too_long(llm: LLM) -> None:
    with pytest.raises(
        ValueError, match="prompt has 64 tokens, the limit is max_model_len - 1 = 63"
    ):
        llm.generate([list(range(64))], PARAMS)
    assert_clean(llm)


def test_empty_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([], PARAMS)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate("", PARAMS)
    assert_clean(llm)


def test_sampling_params_list_of_the_wrong_length(llm: LLM) -> None:
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], [PARAMS])
    assert_clean(llm)


def test_a_rejected_prompt_leaves_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3], [1, 999]], PARAMS)
    try:
        assert_clean(llm)
    finally:
        for rid in list(llm.engine.scheduler.requests):
            llm.engine.abort_request(rid)


def test_string_prompt_with_tokens_outside_the_vocabulary(llm: LLM) -> None:
    assert max(llm.tokenizer.encode("hi")) >= 512  # the tiny model's vocabulary is 512
    try:
        llm.generate("hi", PARAMS)
    except ValueError as e:
        assert "outside the vocabulary" in str(e)
    except IndexError as e:
        raise AssertionError(f"unclear error: {e!r}") from e
    else:
        raise AssertionError("no error for a token id outside the vocabulary")
    finally:
        assert_clean(llm)


# -- mixture of experts ----------------------------------------------------------------------


def test_a_missing_expert_matrix_is_named(tiny_mixtral_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "mixtral"
    shutil.copytree(tiny_mixtral_dir, model)
    edit_weights(model, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    with pytest.raises(ModelLoadError, match=r"block_sparse_moe\.experts\.3\.w3\.weight"):
        load(model)


def test_more_experts_per_token_than_experts_is_refused(tiny_mixtral_dir: Path) -> None:
    cfg = json.loads((tiny_mixtral_dir / "config.json").read_text())
    cfg["num_experts_per_tok"] = cfg["num_local_experts"] + 1
    with pytest.raises(ModelConfigError, match=r"num_experts_per_tok 9 must be in \[1, "):
        ModelConfig.from_dict(cfg)
