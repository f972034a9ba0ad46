"""Grammar engines side by side: llguidance vs xgrammar on the default model's vocabulary.

    python -m hetero_pd.bench.grammar [--model DIR] [--tokens N]

For a JSON schema and a regex it prints, per engine, the first compile time, the per-token
cost of computing the next-token bitmask (the work on the decode step's critical path) and of
advancing the matcher, over the canonical tokenization of a valid document; then which
constructs each engine compiles (JSON schema keywords, regex, EBNF/GBNF, Lark).

Why llguidance is the engine (``hetero_pd/engine/structured.py``), on this bench's numbers
(docs/BENCHMARKS.md, section 13). Against it: xgrammar's masks are much cheaper per token
(p50 ~2 us vs ~30-45 us on 49,152 tokens, and llguidance has rare multi-ms steps where its
lexer explores a string or number), which the engine hides by computing masks while the
forward pass runs. For it, and decisive for a server: a new schema compiles in 1-4 ms
(xgrammar: 45-75 ms of vocabulary precompute, paid by every request with a fresh schema);
no dependencies (xgrammar requires transformers and triton, hundreds of MB on a CPU
install, and the workers never load transformers), it reads the ``tokenizer.json`` the
workers already have, it bounds compile and mask work with explicit limits (a hostile
schema fails fast), it takes Lark besides GBNF, and it refuses what it cannot enforce
(``uniqueItems``) where xgrammar compiles the schema and ignores the keyword.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero_pd.bench.machine import cpu_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "role"],
    "additionalProperties": False,
}
SCHEMA_DOC = (
    '{"name": "Alice Smith", "age": 34, "email": "alice@example.com", '
    '"tags": ["engineer", "python", "llm"], "role": "admin"}'
)
REGEX = r"(\d{3})-(\d{3})-(\d{4}) [A-Z][a-z]+ [A-Z][a-z]+, [a-z]+@[a-z]+\.com"
REGEX_DOC = "415-555-0123 Alice Smith, alice@example.com"

#: Constructs a server is asked for: (kind, label, spec).
COVERAGE: list[tuple[str, str, str]] = [
    (
        "json",
        "$ref/$defs",
        '{"$defs":{"a":{"type":"integer"}},"properties":{"x":{"$ref":"#/$defs/a"}}}',
    ),
    ("json", "anyOf", '{"anyOf":[{"type":"integer"},{"type":"string"}]}'),
    ("json", "oneOf", '{"oneOf":[{"type":"integer"},{"type":"boolean"}]}'),
    (
        "json",
        "allOf",
        '{"allOf":[{"type":"object","properties":{"a":{"type":"integer"}}},{"required":["a"]}]}',
    ),
    ("json", "string pattern", '{"type":"string","pattern":"^[a-z]{3}$"}'),
    ("json", "minLength/maxLength", '{"type":"string","minLength":2,"maxLength":4}'),
    ("json", "format date-time", '{"type":"string","format":"date-time"}'),
    ("json", "format email", '{"type":"string","format":"email"}'),
    ("json", "min/max number", '{"type":"number","minimum":0.5,"maximum":3}'),
    (
        "json",
        "minItems/maxItems",
        '{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3}',
    ),
    ("json", "const/enum", '{"properties":{"a":{"const":1},"b":{"enum":["x",2]}}}'),
    (
        "json",
        "recursive $ref",
        '{"$defs":{"n":{"type":"object","properties":{"c":{"type":"array","items":{"$ref":"#/$defs/n"}}}}},"$ref":"#/$defs/n"}',
    ),
    (
        "json",
        "additionalProperties schema",
        '{"type":"object","additionalProperties":{"type":"integer"}}',
    ),
    (
        "json",
        "prefixItems",
        '{"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}]}',
    ),
    ("json", "multipleOf", '{"type":"integer","multipleOf":3}'),
    ("json", "uniqueItems", '{"type":"array","items":{"type":"integer"},"uniqueItems":true}'),
    ("regex", "classes/quantifiers", r"[A-Z][a-z]{2,5}\d+"),
    ("regex", "alternation/groups", r"(cat|dog)s?( and (cat|dog)s?)*"),
    ("regex", "lookahead", r"(?=a)abc"),
    ("regex", "backreference", r"(a)\1"),
    ("ebnf", "GBNF (llama.cpp)", 'root ::= "yes" | "no" | num\nnum ::= [0-9]+'),
    ("lark", "Lark", 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero-pd bench grammar", description=__doc__)
    parser.add_argument("--model", default=str(_default_model()), help="model folder")
    parser.add_argument("--repeat", type=int, default=20, help="passes over each document")
    args = parser.parse_args(argv)
    model = Path(args.model)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    engines: dict[str, Any] = {"llguidance": _LLGuidance(model, vocab)}
    try:
        engines["xgrammar"] = _XGrammar(model, vocab)
    except ImportError:  # not a dependency: `pip install xgrammar` to compare
        print("xgrammar is not installed: measuring llguidance alone")
    cpu = cpu_info()
    print(f"cpu: {cpu['model']} ({cpu['cores']} cores; {cpu['features']}); vocab {vocab}")
    print(
        f"{'case':<22}{'engine':<12}{'compile ms':>11}{'mask us/tok':>13}"
        f"{'p50 us':>8}{'p99 us':>9}{'advance us':>12}"
    )
    for label, kind, spec, doc in (
        ("json schema", "json", json.dumps(SCHEMA), SCHEMA_DOC),
        ("regex", "regex", REGEX, REGEX_DOC),
    ):
        ids = tok.encode(doc, add_special_tokens=False).ids
        for name, eng in engines.items():
            compile_ms, masks, advances = eng.measure(kind, spec, ids, args.repeat)
            p99 = sorted(masks)[int(len(masks) * 0.99)]
            print(
                f"{label + f' ({len(ids)} tok)':<22}{name:<12}{compile_ms:>11.2f}"
                f"{statistics.mean(masks):>13.1f}{statistics.median(masks):>8.1f}{p99:>9.1f}"
                f"{statistics.mean(advances):>12.1f}"
            )
    print("\ncoverage (compiles = yes)")
    print(f"{'kind':<7}{'construct':<30}" + "".join(f"{n:>12}" for n in engines))
    for kind, label, spec in COVERAGE:
        row = "".join(
            f"{'yes' if eng.compiles(kind, spec) else 'no':>12}" for eng in engines.values()
        )
        print(f"{kind:<7}{label:<30}{row}")
    return 0


def _default_model() -> Path:
    return Path.home() / ".cache" / "hetero-pd" / "models" / "smollm2-135m-instruct"


def _time(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


class _LLGuidance:
    def __init__(self, model: Path, vocab: int) -> None:
        import llguidance
        import llguidance.torch as llt

        self._ll, self._llt = llguidance, llt
        text = (model / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab)
        self.vocab = vocab

    def _grammar(self, kind: str, spec: str) -> str:
        from llguidance import grammar_from

        return grammar_from({"json": "json_schema", "ebnf": "gbnf"}.get(kind, kind), spec)  # type: ignore[arg-type]

    def compiles(self, kind: str, spec: str) -> bool:
        try:
            m = self._ll.LLMatcher(self.tokenizer, self._grammar(kind, spec), log_level=0)
        except Exception:
            return False
        return not m.is_error()

    def measure(self, kind: str, spec: str, ids: list[int], repeat: int):  # type: ignore[no-untyped-def]
        grammar = self._grammar(kind, spec)
        _, compile_s = _time(lambda: self._ll.LLMatcher(self.tokenizer, grammar))
        mask = self._llt.allocate_token_bitmask(1, self.vocab)
        masks, advances = [], []
        for _ in range(repeat):
            m = self._ll.LLMatcher(self.tokenizer, grammar)
            for t in ids:
                start = time.perf_counter()
                self._llt.fill_next_token_bitmask(m, mask, 0)
                mid = time.perf_counter()
                ok = m.consume_token(t)
                masks.append((mid - start) * 1e6)
                advances.append((time.perf_counter() - mid) * 1e6)
                assert ok, m.get_error()
        return compile_s * 1e3, masks, advances


class _XGrammar:
    def __init__(self, model: Path, vocab: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        hf = AutoTokenizer.from_pretrained(str(model))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.info, self.vocab = info, vocab

    def _compile(self, kind: str, spec: str, compiler: Any = None) -> Any:
        c = compiler or self._xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(spec)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "ebnf":
            return c.compile_grammar(spec)
        raise ValueError(f"xgrammar has no {kind} front end")

    def compiles(self, kind: str, spec: str) -> bool:
        try:
            self._compile(kind, spec)
        except Exception:
            return False
        return True

    def measure(self, kind: str, spec: str, ids: list[int], repeat: int):  # type: ignore[no-untyped-def]
        compiled, compile_s = _time(lambda: self._compile(kind, spec))
        mask = self._xgr.allocate_token_bitmask(1, self.vocab)
        masks, advances = [], []
        for _ in range(repeat):
            m = self._xgr.GrammarMatcher(compiled)
            for t in ids:
                start = time.perf_counter()
                m.fill_next_token_bitmask(mask)
                mid = time.perf_counter()
                ok = m.accept_token(t)
                masks.append((mid - start) * 1e6)
                advances.append((time.perf_counter() - mid) * 1e6)
                assert ok, f"xgrammar refused token {t}"
        return compile_s * 1e3, masks, advances


if __name__ == "__main__":
    raise SystemExit(main())
