"""`load_tokenizer` gives exactly the tokenizer AutoTokenizer gives, by a shorter road."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from hetero_pd.models import tokenizer as tok

TEXTS = [
    "Hello  world\n\tthe capital of France",
    "Ünïcødé 🚀 <|im_start|>user\nx<|im_end|>",
    "",
    " leading space, trailing space ",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? 🚀"},
]


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    assert vars(a).keys() == vars(b).keys()
    for name in ("init_kwargs", "chat_template", "all_special_ids", "model_max_length"):
        assert getattr(a, name) == getattr(b, name), name
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"], text  # type: ignore[operator]
    ids = list(range(0, 2000, 7))
    assert a.decode(ids) == b.decode(ids)  # type: ignore[attr-defined]
    assert a.apply_chat_template(  # type: ignore[attr-defined]
        CHAT, add_generation_prompt=True, tokenize=False
    ) == b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]


def test_the_default_model_loads_directly_and_equals_autotokenizer(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("AutoTokenizer was used for a folder that names its class")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    _same(tok.load_tokenizer(tokenizer_dir), reference)


def test_a_folder_that_names_another_class_goes_through_autotokenizer(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "SomethingElse"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    used: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path: str, *args: object, **kwargs: object) -> object:
        used.append(path)
        return real(str(tokenizer_dir))  # the class named here does not exist

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    tok.load_tokenizer(tmp_path)
    assert used == [str(tmp_path)]
