"""Incremental detokenization: output token ids in, finalized text deltas out."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetero_pd.models.tokenizer import TokenDecoder

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so the first output token gets its context
# (e.g. the leading space SentencePiece tokenizers strip from the first token of a text).
PROMPT_CONTEXT_TOKENS = 5


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
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its last bytes would merge with the
            # output's first ones, so decode the output on its own.
            context = []
        self._ids = context
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
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
