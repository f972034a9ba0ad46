"""Structured outputs in the engine: grammars compiled with llguidance, one matcher per
request, token bitmasks computed while the forward pass runs.

Why llguidance and not xgrammar: ``hetero_pd/bench/grammar.py`` (it compiles a schema in
1-4 ms against 45-75 ms, needs no transformers or triton, bounds its own work, and refuses
what it cannot enforce); its per-token masks cost more (p50 ~30 us, rare multi-ms steps),
so they are computed on a thread while the forward pass runs.

    step:  prepare ──> start_masks (thread: each matcher fills its row) ──┐
                        forward pass (torch)                              │
           logits ──> apply mask (first) ──> bans, bias, penalties ──> sample
           sampled token ──> matcher.accept ──> complete? ──> FINISHED_STOPPED
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.structured_outputs import JSON_OPTIONS, StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

#: Compiled grammars kept per engine (the cache's key: kind and spec).
CACHE_SIZE = 256
# Work bounds of one grammar (llguidance's fuel: ~50k/ms when building, ~14k/ms per mask):
# a hostile grammar fails to compile in tens of ms rather than stalling the engine.
_LIMITS = {
    "initial_lexer_fuel": 2_000_000,
    "step_lexer_fuel": 400_000,
    "max_grammar_size": 200_000,
    "max_lexer_states": 100_000,
    "verbose_errors": False,
}


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message says what is wrong."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar; raises GrammarError for a malformed spec."""
    import llguidance

    kind, spec = params.key()
    m = llguidance.LLMatcher
    try:
        if kind == "json":
            return m.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "json_object":
            return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "regex":
            return m.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", spec)
    except ValueError as e:
        raise GrammarError(f"structured_outputs.{kind}: {e}") from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raises GrammarError naming what is wrong when the constraint cannot be compiled (a
    schema keyword llguidance does not enforce, a regex with look-around, a bad grammar).
    Needs no tokenizer: the API calls it before a request reaches a worker."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(params), None, limits=_limits())
    if error:
        raise GrammarError(f"structured_outputs.{params.kind}: {error}")


@functools.cache
def _limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(**_LIMITS)  # type: ignore[arg-type]


class GrammarMatcher:
    """One request's place in its grammar."""

    __slots__ = ("_m", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._m

    def accept(self, token: int) -> None:
        """Advances over a sampled token; raises ValueError when the grammar refuses it."""
        if not self._m.consume_token(token):
            raise ValueError(f"token {token} breaks the request's grammar: {self._m.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and admits nothing more (the request stops here)."""
        return self._m.is_stopped()


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary, keeping the last `CACHE_SIZE`
    compiled grammars by (kind, spec); each request gets a copy of the cached one."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._path = model_path / "tokenizer.json"
        self._vocab = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def for_params(self, params: SamplingParams) -> GrammarMatcher | None:
        """The matcher of a request's constraint; None when it has none."""
        so = params.structured_outputs
        return None if so is None else self.matcher(so)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises GrammarError when it cannot compile."""
        key = params.key()
        template = self._cache.get(key)
        if template is None:
            template = self._compile(params)
            self._cache[key] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy(), self._vocab)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        import llguidance

        if self._tokenizer is None:
            if not self._path.is_file():
                raise GrammarError(f"structured outputs need {self._path}, which is missing")
            self._tokenizer = llguidance.LLTokenizer(
                self._path.read_text(), n_vocab=self._vocab, eos_token=self._eos or None
            )
        m = llguidance.LLMatcher(
            self._tokenizer, grammar_text(params), log_level=0, limits=_limits()
        )
        if m.is_error():
            raise GrammarError(f"structured_outputs.{params.kind}: {m.get_error()}")
        return m


class TokenMasks:
    """Fills the bitmask rows of a step's constrained requests on a background thread
    (llguidance drops the GIL), so the work overlaps the forward pass."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, matchers: Sequence[GrammarMatcher | None]) -> Future[torch.Tensor] | None:
        """Starts the masks of one step's rows (None where a row is unconstrained): a future
        of the ``[rows, words]`` int32 bitmask (bit ``t`` of a row: token ``t`` allowed)."""
        rows = [(m.llmatcher, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (max(m.vocab_size for m in matchers if m is not None) + 31) // 32
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self._fill, rows, len(matchers), words)

    def _fill(
        self, rows: list[tuple[llguidance.LLMatcher, int]], n: int, words: int
    ) -> torch.Tensor:
        bitmask = torch.full((n, words), -1, dtype=torch.int32)
        row_bytes = words * 4
        for matcher, i in rows:
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
        return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token a row's bitmask disallows set to ``-inf`` (a copy)."""
    vocab = logits.shape[-1]
    # Bit t of a row is token t (little-endian words): numpy unpacks that in one C pass.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    ok = torch.from_numpy(bits.view(np.bool_))[:, :vocab]
    if ok.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary: never those
        ok = torch.nn.functional.pad(ok, (0, vocab - ok.shape[1]), value=False)
    return logits.masked_fill(~ok.to(logits.device), float("-inf"))


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
