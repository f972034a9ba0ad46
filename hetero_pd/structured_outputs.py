"""A request's structured-output constraint (mirrors vLLM's ``StructuredOutputsParams``).

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (EBNF/GBNF or
Lark) or ``json_object`` (any JSON object) is set. The engine compiles it with llguidance
(``hetero_pd.engine.structured``) and masks every sampled token with it; here it is only
validated for shape and size, so that it can travel on the control wire as ``(kind, spec)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

#: Largest spec (schema JSON, regex, grammar or choices as JSON) a request may carry: a
#: hostile client must not make a worker compile a huge grammar.
MAX_SPEC_BYTES = 64 * 1024
#: Most alternatives of a ``choice``.
MAX_CHOICES = 1024
#: How every JSON the engine constrains is written (llguidance's JSON options): compact and
#: deterministic, since free whitespace lets a small model loop on newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

Kind = Literal["json", "regex", "choice", "grammar", "json_object"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on a completion's text.

    Attributes:
        json: a JSON schema, as a dict or a JSON string (kept as the string); the output is
            a JSON value it accepts.
        regex: the output matches this regular expression (whole text).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, GBNF (``root ::= ...``, llama.cpp's and vLLM's
            EBNF) or Lark (``start: ...``).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if isinstance(self.json, dict):  # kept as JSON text: one form on the wire and in caches
            object.__setattr__(self, "json", _schema_text(self.json))
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        kind, spec = self.key()
        if len(spec.encode()) > MAX_SPEC_BYTES:
            raise ValueError(
                f"structured_outputs.{kind} is {len(spec.encode())} bytes, at most {MAX_SPEC_BYTES}"
            )

    @property
    def kind(self) -> Kind:
        return self.key()[0]

    def key(self) -> tuple[Kind, str]:
        """``(kind, spec)``: what identifies the compiled grammar, and what the wire carries."""
        if self.json is not None:
            return "json", _schema_text(self.json)
        if self.regex is not None:
            return "regex", _text("regex", self.regex)
        if self.choice is not None:
            return "choice", _choices(self.choice)
        if self.grammar is not None:
            return "grammar", _text("grammar", self.grammar)
        return "json_object", ""

    @classmethod
    def from_key(cls, kind: str, spec: str) -> StructuredOutputsParams:
        """The inverse of ``key()``; raises ValueError for an unknown kind or a bad spec."""
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            return cls(choice=json.loads(spec))
        if kind == "json":
            return cls(json=spec)
        if kind == "regex":
            return cls(regex=spec)
        if kind == "grammar":
            return cls(grammar=spec)
        raise ValueError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
    return value


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a schema object, got {schema!r}")
    return json.dumps(schema, separators=(",", ":"))


def _choices(choice: Any) -> str:
    if not isinstance(choice, (list, tuple)) or not choice or len(choice) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
    if not all(isinstance(c, str) and c for c in choice):
        raise ValueError("structured_outputs.choice must hold only non-empty strings")
    return json.dumps(list(choice), separators=(",", ":"))
