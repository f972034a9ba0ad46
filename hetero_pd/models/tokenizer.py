"""Loading a model folder's tokenizer without the cost of `AutoTokenizer`'s detour.

`AutoTokenizer.from_pretrained` first loads the model's config class to learn which tokenizer
class to build; for Llama that import pulls in torch.distributed.tensor and sympy, 3-7 s of
CPU in every worker, router and engine process on a 2-core machine. When the folder itself
names the tokenizers-library class (`tokenizer_class` "TokenizersBackend", or
"PreTrainedTokenizerFast", which transformers 5 makes the same class) and holds
`tokenizer.json`, that is the class AutoTokenizer would build: it is loaded directly. Any
other folder goes through AutoTokenizer as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

#: `tokenizer_class` values loaded directly (the class of that name in transformers).
DIRECT_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(path)` would give (see module doc)."""
    import transformers

    folder = Path(path)
    name = _named_class(folder)
    cls = getattr(transformers, name, None) if name in DIRECT_CLASSES else None
    if cls is not None and (folder / "tokenizer.json").is_file():
        tokenizer: PreTrainedTokenizerBase = cls.from_pretrained(str(folder))
        return tokenizer
    auto: PreTrainedTokenizerBase = transformers.AutoTokenizer.from_pretrained(str(folder))
    return auto


def _named_class(folder: Path) -> str | None:
    name = _tokenizer_config(folder).get("tokenizer_class")
    return name if isinstance(name, str) else None


class TokenDecoder:
    """What an engine needs of a tokenizer to turn output ids into text: `decode` and the
    end-of-sequence id. A serving worker never tokenizes (the router sends token ids), so
    it need not import transformers (~2 s of CPU in every worker process): where the folder
    is one `load_tokenizer` loads directly, the tokenizers library's own `Tokenizer` decodes,
    which is what that class's `decode` calls with tokenization-space clean-up off."""

    def __init__(
        self,
        decode: Callable[[list[int], bool], str],
        eos_token_id: int | None,
        backend: Tokenizer | None = None,
    ):
        self._decode = decode
        self.eos_token_id = eos_token_id
        #: The tokenizers library's Tokenizer that `decode` calls, where it is that one
        #: (engine/detokenizer.py streams from it).
        self.backend = backend

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(ids, skip_special_tokens)

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenDecoder:
        """A transformers tokenizer's decoding, clean-up off."""

        def decode(ids: list[int], skip: bool) -> str:
            text = tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert isinstance(text, str)  # a flat list of ids decodes to one string
            return text

        eos = tokenizer.eos_token_id
        return cls(decode, eos if isinstance(eos, int) else None)


def load_decoder(path: str | Path) -> TokenDecoder:
    """The decoding of `load_tokenizer(path)`, without transformers where the folder allows
    (its class is one of DIRECT_CLASSES, and tokenizer.json marks special exactly the tokens
    tokenizer_config.json names)."""
    folder = Path(path)
    config = _tokenizer_config(folder)
    if config.get("tokenizer_class") in DIRECT_CLASSES and (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        special = _special_tokens(backend)
        if _config_agrees(config, special):
            eos = _content(config.get("eos_token"))
            return TokenDecoder(
                lambda ids, skip: backend.decode(ids, skip_special_tokens=skip),
                None if eos is None else special.get(eos),
                backend,
            )
    return TokenDecoder.of(load_tokenizer(folder))


def _special_tokens(backend: Tokenizer) -> dict[str, int]:
    """The backend's added tokens marked special: content -> id."""
    added = backend.get_added_tokens_decoder()
    return {t.content: i for i, t in added.items() if t.special}


def _config_agrees(config: dict[str, Any], special: dict[str, int]) -> bool:
    """Every token the config names as special is special in tokenizer.json, at its id, and
    no token the config lists as added is special in one and not the other."""
    named = [config.get(key) for key in _NAMED_TOKENS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named += list(extra.values()) if isinstance(extra, dict) else list(extra)
    for token in named:
        content = _content(token)
        if token is not None and (content is None or content not in special):
            return False
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return False
    for token_id, token in decoder.items():
        if not isinstance(token, dict) or not str(token_id).isdigit():
            return False
        is_special = special.get(str(token.get("content"))) == int(token_id)
        if bool(token.get("special")) != is_special:
            return False
    return True


_NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _content(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
