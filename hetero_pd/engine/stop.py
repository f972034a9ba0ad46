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
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        """The checker for a request's ``stop`` and ``include_stop_str_in_output``."""
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        return cls(stop, params.include_stop_str_in_output)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, text: str, new_text_len: int) -> StopMatch | None:
        """Look for a stop string that ends within the last ``new_text_len`` characters.

        Only the tail that can hold a new match is searched (``new_text_len`` plus the stop
        string's length minus one characters), so a call costs O(delta), not O(text).
        Returns where to truncate ``text`` (before the stop string, or after it when
        ``include_stop_str_in_output``), or ``None``.
        """
        if new_text_len <= 0:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            search_from = max(0, len(text) - new_text_len - len(stop_str) + 1)
            start = text.find(stop_str, search_from)
            if start < 0:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop_str = best
        return StopMatch(stop_str, end if self.include_stop_str_in_output else start)

    def streamable_text_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that is safe to stream.

        Holds back the longest suffix of ``text`` that is a proper prefix of a stop string
        (it may still become a stop string that is cut off). Nothing is held back when
        ``include_stop_str_in_output`` is set, since the text is kept either way. For a text
        that only grows and has no match, the result never decreases.
        """
        if self.include_stop_str_in_output:
            return len(text)
        held = 0
        for stop_str in self.stop:
            for size in range(min(len(stop_str) - 1, len(text)), held, -1):
                if text.endswith(stop_str[:size]):
                    held = size
                    break
        return len(text) - held


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
