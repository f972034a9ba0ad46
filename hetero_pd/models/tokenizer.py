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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None
