"""`load_tokenizer` gives exactly the tokenizer AutoTokenizer gives, by a shorter road."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


def _copy_naming_another_class(tokenizer_dir: Path, dest: Path) -> None:
    """The tokenizer files, with tokenizer_config.json naming a class not loaded directly."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "SomethingElse"
    (dest / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_folder_that_names_another_class_goes_through_autotokenizer(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _copy_naming_another_class(tokenizer_dir, tmp_path)
    used: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path: str, *args: object, **kwargs: object) -> object:
        used.append(path)
        return real(str(tokenizer_dir))  # the class named here does not exist

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    tok.load_tokenizer(tmp_path)
    assert used == [str(tmp_path)]


def _decodes_alike(decoder: tok.TokenDecoder, reference: object) -> None:
    special = list(reference.all_special_ids)  # type: ignore[attr-defined]
    ids = [*range(0, 3000, 11), *special, 60, *special[:2], 61]
    for skip in (False, True):
        want = reference.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]
        assert decoder.decode(ids, skip_special_tokens=skip) == want
    assert decoder.eos_token_id == reference.eos_token_id  # type: ignore[attr-defined]


def test_the_engine_decodes_the_default_model_without_transformers(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def refuse(path: object) -> None:
        raise AssertionError("the decoder fell back to transformers")

    monkeypatch.setattr(tok, "load_tokenizer", refuse)
    decoder = tok.load_decoder(tokenizer_dir)
    _decodes_alike(decoder, reference)
    code = (
        "import sys; from hetero_pd.models.tokenizer import load_decoder; "
        f"d = load_decoder({str(tokenizer_dir)!r}); d.decode([1, 2, 3]); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_config_naming_a_special_token_the_backend_lacks_falls_back(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenizer.json without a token the config calls special: transformers would add it,
    so the decoder must be transformers' own."""
    backend = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    eos = next(t for t in backend["added_tokens"] if t["content"] == "<|im_end|>")
    eos["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(backend))
    shutil.copy(tokenizer_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    used: list[object] = []
    monkeypatch.setattr(tok, "load_tokenizer", lambda path: used.append(path) or reference)
    decoder = tok.load_decoder(tmp_path)
    assert used == [tmp_path]
    assert "<|im_end|>" not in decoder.decode([2], skip_special_tokens=True)
    _decodes_alike(decoder, reference)


def test_a_folder_of_another_class_decodes_through_transformers(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _copy_naming_another_class(tokenizer_dir, tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    monkeypatch.setattr(tok, "load_tokenizer", lambda path: reference)
    _decodes_alike(tok.load_decoder(tmp_path), reference)
