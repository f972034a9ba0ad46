"""Incremental detokenization: output token ids in, finalized text deltas out.

`detokenizer()` picks the implementation: tokenizers' `DecodeStream` (its window kept in
Rust, no Python decode per token) where the engine's TokenDecoder decodes with the
tokenizers library itself, the Python window otherwise. Both emit the same deltas
(tests/engine/test_detokenizer.py runs every case on both); `hetero-pd bench per-token`
measures them side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from hetero_pd.models.tokenizer import TokenDecoder

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so the first output token gets its context
# (e.g. the leading space SentencePiece tokenizers strip from the first token of a text).
PROMPT_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    """What the output builder needs of an incremental detokenizer."""

    @property
    def text(self) -> str: ...

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def detokenizer(
    tokenizer: TokenDecoder,
    prompt_token_ids: list[int],
    skip_special_tokens: bool = True,
    stream: bool | None = None,
) -> Detokenizer:
    """The fastest detokenizer for `tokenizer`: `StreamDetokenizer` where it decodes with a
    `tokenizers` backend, else `IncrementalDetokenizer`. `stream` forces one (tests)."""
    backend = tokenizer.backend
    if stream is None:
        stream = backend is not None
    if stream:
        if backend is None:
            raise ValueError("this tokenizer has no tokenizers backend to stream from")
        return StreamDetokenizer(tokenizer, backend, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


def _prompt_context(tokenizer: TokenDecoder, prompt: list[int], skip: bool) -> list[int]:
    """The last prompt ids decoded ahead of the output, none where they end inside a character
    (its last bytes would merge with the output's first ones)."""
    context = list(prompt[-PROMPT_CONTEXT_TOKENS:])
    if context and _decode(tokenizer, context, skip).endswith(REPLACEMENT_CHAR):
        return []
    return context


def _decode(tokenizer: TokenDecoder, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip) if ids else ""


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas without splitting characters.

    It keeps a small window of ids::

        ids:  ... | prefix_offset ......... read_offset ......... end |
                    └ already emitted, ────┘└ not yet emitted ───┘
                      decoded for context

    Each :meth:`add` decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``
    and emits the difference, unless it ends with U+FFFD (a multi-byte character whose
    remaining bytes are in tokens still to come): then it emits ``""`` and waits. The
    window normally holds two or three tokens, so each step costs O(1) in the output length.

    For byte-level BPE tokenizers (the default model) :attr:`text` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` once the output ends on a
    complete character; call :meth:`flush` at the end to also get a trailing incomplete
    character as U+FFFD, as the full decode does. For SentencePiece-style tokenizers the first
    output token keeps its leading space (decoded after the prompt), as vLLM does.
    Tokenization-space clean-up is never applied.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        context = self._ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """The output text finalized so far (the concatenation of all deltas)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly finalized text, possibly ``""``."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Finalize text still held back (an incomplete character decodes to U+FFFD).

        Call once when the request finishes; returns ``""`` when nothing was pending.
        """
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        if not delta:
            # E.g. a skipped special token: keep the window so the next token keeps its
            # context.
            return ""
        # The unread part becomes the new context; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return _decode(self._tokenizer, ids, self._skip_special_tokens)


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s deltas from tokenizers' `DecodeStream`, which keeps the same
    window (decoded for context, not yet emitted) in Rust: no Python decode per token.

    `DecodeStream` has no flush: the ids it holds back (an unfinished character) are kept
    here too, so that `flush` decodes them after the last emitted ones, as the full decode
    does. A decoder whose text for a longer window does not start with the shorter one's
    (DecodeStream's "invalid prefix") is an error worth seeing, not hidden."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        backend: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer, self._backend = tokenizer, backend
        self._skip = skip_special_tokens
        context = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._emitted = context  # the ids of the last delta (context for what follows)
        self._held: list[int] = []  # ids added since, not yet emitted
        self._text = ""

    @property
    def text(self) -> str:
        """The output text finalized so far (the concatenation of all deltas)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly finalized text, possibly ``""``."""
        self._held.append(token_id)
        delta = self._stream.step(self._backend, token_id)
        if delta is None:
            return ""
        self._emitted, self._held = self._held, []
        self._text += delta
        return delta

    def flush(self) -> str:
        """Finalize text still held back (an incomplete character decodes to U+FFFD)."""
        if not self._held:
            return ""
        window = self._emitted + self._held
        done = _decode(self._tokenizer, self._emitted, self._skip)
        delta = _decode(self._tokenizer, window, self._skip)[len(done) :]
        self._emitted, self._held = window, []
        self._text += delta
        return delta
