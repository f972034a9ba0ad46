"""Stop strings (with streaming hold-back) and the min_tokens ban on stop tokens."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from hetero_pd.sampling_params import SamplingParams


class StopMatch(NamedTuple):
    """A stop string found in the output text."""

    stop_str: str
    """The stop string that matched (vLLM's ``stop_reason``)."""
    text_len: int
    """Length to truncate the output text to: ``text[:text_len]`` is the final text."""


class StopChecker:
    """Finds stop strings in a growing output text.

    Use, after each detokenizer delta::

        match = checker.check(detok.text, len(delta))
        if match:                       # finished: final text is detok.text[:match.text_len]
            ...
        else:                           # still running: stream only what cannot change
            end = checker.streamable_text_len(detok.text)
            send(detok.text[sent:end]); sent = end

    When the request finishes for another reason (EOS, length) stream the rest of the text.
    The result does not depend on how the text was split into deltas: the match reported is
    the one that ends first (then, among those, starts first), as if text came one character
    at a time.

    Each stop string runs a KMP automaton over the text, fed only the characters added since
    the last call (a text that does not extend the previous one is fed from its start), so a
    request's whole output costs O(output length x number of stop strings), whatever the
    stop strings' lengths.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._automata = [_Automaton(s) for s in self.stop]
        self._text = ""  # what the automata have consumed
        self._matches: list[tuple[int, int, str]] = []  # (end, start, stop) in self._text

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        """The checker for a request's ``stop`` and ``include_stop_str_in_output``."""
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        return cls(stop, params.include_stop_str_in_output)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, text: str, new_text_len: int) -> StopMatch | None:
        """Look for a stop string that ends within the last ``new_text_len`` characters.

        Returns where to truncate ``text`` (before the stop string, or after it when
        ``include_stop_str_in_output``), or ``None``.
        """
        if new_text_len <= 0 or not self.stop:
            return None
        self._consume(text)
        first_end = len(text) - new_text_len
        found = [m for m in self._matches if m[0] > first_end]
        if not found:
            return None
        end, start, stop_str = min(found)
        return StopMatch(stop_str, end if self.include_stop_str_in_output else start)

    def streamable_text_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that is safe to stream.

        Holds back the longest suffix of ``text`` that is a proper prefix of a stop string
        (it may still become a stop string that is cut off). Nothing is held back when
        ``include_stop_str_in_output`` is set, since the text is kept either way. For a text
        that only grows and has no match, the result never decreases.
        """
        if self.include_stop_str_in_output or not self.stop:
            return len(text)
        self._consume(text)
        return len(text) - max(a.state for a in self._automata)

    def _consume(self, text: str) -> None:
        if not text.startswith(self._text):
            for automaton in self._automata:
                automaton.state = 0
            self._text, self._matches = "", []
        start = len(self._text)
        for automaton in self._automata:
            for end in automaton.feed(text, start):
                self._matches.append((end, end - len(automaton.stop), automaton.stop))
        self._text = text


class _Automaton:
    """KMP matcher of one stop string; `state` is the length of the longest proper prefix
    of the stop string that the text consumed so far ends with."""

    __slots__ = ("fail", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix.
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str, start: int) -> list[int]:
        """Consumes ``text[start:]``; returns where the matches in it end."""
        stop, fail, state, n = self.stop, self.fail, self.state, len(self.stop)
        ends = []
        for i in range(start, len(text)):
            c = text[i]
            while state and stop[state] != c:
                state = fail[state - 1]
            if stop[state] == c:
                state += 1
            if state == n:
                ends.append(i + 1)
                state = fail[n - 1]
        self.state = state
        return ends


def suppressed_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> list[int]:
    """Token ids the next token must not be, for ``Sampler(suppress_token_ids=...)``.

    ``num_output_tokens`` counts the tokens generated so far, before the one being sampled.
    While it is below ``min_tokens`` that is EOS (unless ``ignore_eos``) and
    ``stop_token_ids``, so the request cannot stop early; afterwards, none.
    """
    if num_output_tokens >= params.min_tokens:
        return []
    banned = [] if params.ignore_eos else list(eos_token_ids)
    return banned + [t for t in params.stop_token_ids or [] if t not in banned]
