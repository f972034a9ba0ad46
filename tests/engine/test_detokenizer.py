"""The incremental detokenizers (the Python window and tokenizers' DecodeStream, each case run
on both) against full decodes, and stop strings with streaming hold-back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, detokenizer
from hetero_pd.engine.stop import StopChecker, suppressed_token_ids
from hetero_pd.models.tokenizer import TokenDecoder, load_decoder
from hetero_pd.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain English sentence.\n\nWith two paragraphs.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。",
    "Emoji: 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 thumbs 👍🏽 done",
    "Ünïcödé àccents: naïve café, Ærøskøbing, Łódź, Ελληνικά, русский текст",
    "def f(x):\n    return x ** 2  # ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n\t\tmixed   spaces",
    "中英混合 mixed 文本 with 数字 12345 and 符号 ¥€£ and 😀",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def decoder(tokenizer: Any) -> TokenDecoder:
    """What the engine decodes with (the tokenizers library's, for the default model)."""
    return load_decoder(tokenizer.name_or_path)


class _WindowSpy:
    """Forwards decode() to a tokenizer and records the longest id list it was given."""

    backend = None  # a decoder of its own: nothing to stream from

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(params=[False, True], ids=["python", "decode_stream"])
def stream(request: pytest.FixtureRequest) -> bool:
    """Each detokenizer in turn: the Python window, then tokenizers' DecodeStream."""
    return bool(request.param)


def _stream(
    decoder: TokenDecoder, prompt: list[int], output: list[int], stream: bool, **kw: Any
) -> list[str]:
    detok = detokenizer(decoder, prompt, stream=stream, **kw)
    assert isinstance(detok, StreamDetokenizer if stream else IncrementalDetokenizer)
    deltas = [detok.add(t) for t in output]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_equal_full_decode_and_never_split_characters(
    tokenizer: Any, text: str, stream: bool, decoder: TokenDecoder
) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode(text)
    detok = detokenizer(decoder, prompt, stream=stream)
    for n, token in enumerate(output, start=1):
        delta = detok.add(token)
        assert "\ufffd" not in delta
        # Final text so far is the full decode up to here, less the text of the tokens that
        # end in an unfinished character.
        assert tokenizer.decode(output[:n]).startswith(detok.text)
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(output) == text


def test_random_token_sequences_equal_full_decode(
    tokenizer: Any, stream: bool, decoder: TokenDecoder
) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    # Byte-level tokens of multi-byte characters stress the incomplete-character path.
    pieces = [t for text in TEXTS[1:4] for t in tokenizer.encode(text)]
    for _ in range(150):
        pool = pieces if rng.random() < 0.5 else range(17, vocab)
        output = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(17, vocab) for _ in range(rng.randint(0, 8))]
        deltas = _stream(decoder, prompt, output, stream)
        assert "".join(deltas) == tokenizer.decode(output), (prompt, output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Any, skip: bool, stream: bool, decoder: TokenDecoder) -> None:
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    output = [
        *tokenizer.encode("Hi 你"),
        im_end,
        im_start,
        *tokenizer.encode(" there 🎉"),
        im_end,
    ]
    deltas = _stream(decoder, [im_start], output, stream, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_prompt_ending_inside_a_character(
    tokenizer: Any, stream: bool, decoder: TokenDecoder
) -> None:
    ids = tokenizer.encode("你好世界")
    prompt, output = ids[:1], ids[1:]  # the first token holds only part of "你"
    assert tokenizer.decode(prompt).endswith("\ufffd")
    deltas = _stream(decoder, prompt, output, stream)
    assert "".join(deltas) == tokenizer.decode(output)


def test_an_unfinished_last_character_is_flushed_as_a_replacement(
    tokenizer: Any, stream: bool, decoder: TokenDecoder
) -> None:
    ids = tokenizer.encode("ok 🎉")
    output = ids[:-1]  # the emoji's last byte never comes
    deltas = _stream(decoder, tokenizer.encode("Q?"), output, stream)
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(output)


def test_both_detokenizers_stream_the_same_deltas(tokenizer: Any, decoder: TokenDecoder) -> None:
    """Not only the same text: the same delta at every token (what a client is streamed),
    special tokens skipped or not, prompts ending inside a character or not."""
    rng = random.Random(2)
    specials = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    pieces = [t for text in TEXTS for t in tokenizer.encode(text)] + specials * 20
    for _ in range(100):
        output = [rng.choice(pieces) for _ in range(rng.randint(1, 30))]
        prompt = [rng.choice(pieces) for _ in range(rng.randint(0, 8))]
        skip = rng.random() < 0.5
        python, rust = (
            _stream(decoder, prompt, output, s, skip_special_tokens=skip) for s in (False, True)
        )
        assert python == rust, (prompt, output, skip)


def test_streaming_needs_a_tokenizers_backend(tokenizer: Any, decoder: TokenDecoder) -> None:
    assert isinstance(detokenizer(decoder, []), StreamDetokenizer)  # the default model's
    via_transformers = TokenDecoder.of(tokenizer)
    with pytest.raises(ValueError, match="has no tokenizers backend to stream"):
        detokenizer(via_transformers, [], stream=True)
    assert isinstance(detokenizer(via_transformers, []), IncrementalDetokenizer)


def test_decode_window_stays_small(tokenizer: Any, decoder: TokenDecoder) -> None:
    spy = _WindowSpy(decoder)
    output = tokenizer.encode(" ".join(TEXTS) * 4)
    assert len(output) > 500
    detok = IncrementalDetokenizer(spy, tokenizer.encode("prompt"))
    for token in output:
        detok.add(token)
    assert detok.text == tokenizer.decode(output)
    assert spy.longest <= 12


# --- stop strings ---------------------------------------------------------------------


def _check_in_chunks(checker: StopChecker, text: str, cuts: list[int]) -> Any:
    """Feed ``text`` in chunks ending at ``cuts``; return the first match."""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        match = checker.check(text[:end], end - start)
        if match:
            return match
    return None


def test_stop_truncates_before_or_after_the_stop_string() -> None:
    assert StopChecker(["###"]).check("abc###def", 9) == ("###", 3)
    assert StopChecker(["###"], include_stop_str_in_output=True).check("abc###def", 9) == (
        "###",
        6,
    )
    assert StopChecker(["###"]).check("abc##", 5) is None
    assert StopChecker(["x"]).check("xabc", 0) is None
    assert not StopChecker([]) and StopChecker([]).check("abc", 3) is None


def test_stop_across_delta_boundaries() -> None:
    checker = StopChecker(["<END>"])
    assert _check_in_chunks(checker, "hello <END> world", [7, 8, 9, 10, 13]) == ("<END>", 6)
    # The tail searched must reach back into earlier text for the start of the stop string.
    assert checker.check("hello <END", 1) is None
    assert checker.check("hello <END>", 1) == ("<END>", 6)
    # A match entirely inside old text is not reported again.
    assert checker.check("<END> and more", 4) is None


def test_first_ending_match_wins_whatever_the_chunking() -> None:
    rng = random.Random(1)
    stops = ["ab", "b", "abc", "ca", "cab"]
    for _ in range(300):
        text = "".join(rng.choice("abcx") for _ in range(rng.randint(1, 12)))
        by_char = _check_in_chunks(StopChecker(stops), text, list(range(1, len(text))))
        cuts = sorted(rng.sample(range(1, len(text) + 1), rng.randint(0, len(text) - 1)))
        cuts = [c for c in cuts if c < len(text)]
        assert _check_in_chunks(StopChecker(stops), text, cuts) == by_char, (text, cuts)
    assert StopChecker(["cab", "ab"]).check("xcab", 4) == ("cab", 1)  # same end: earliest start
    assert StopChecker(["bc", "abcd"]).check("abcd", 4) == ("bc", 1)  # earliest end


def test_streamable_text_len_holds_back_partial_stop_strings() -> None:
    checker = StopChecker(["</s>", "STOP"])
    assert checker.streamable_text_len("hello") == 5
    assert checker.streamable_text_len("hello<") == 5
    assert checker.streamable_text_len("hello</") == 5
    assert checker.streamable_text_len("hello</s") == 5
    assert checker.streamable_text_len("hello</x") == 8
    assert checker.streamable_text_len("hello ST") == 6
    assert checker.streamable_text_len("") == 0
    include = StopChecker(["</s>"], include_stop_str_in_output=True)
    assert include.streamable_text_len("hello</s") == 8


def test_streaming_never_shows_a_partial_stop_string(
    tokenizer: Any, stream: bool, decoder: TokenDecoder
) -> None:
    text = "The answer is 42. Observation: 你好 done"
    params = SamplingParams(stop=["Observation:", "zzz"])
    detok = detokenizer(decoder, tokenizer.encode("Q?"), stream=stream)
    checker = StopChecker.from_params(params)
    streamed, match = "", None
    for token in tokenizer.encode(text):
        delta = detok.add(token)
        match = checker.check(detok.text, len(delta))
        if match:
            streamed += detok.text[len(streamed) : match.text_len]
            break
        streamed += detok.text[len(streamed) : checker.streamable_text_len(detok.text)]
        assert "Obs" not in streamed
    assert match == ("Observation:", len("The answer is 42. "))
    assert streamed == "The answer is 42. "


def test_suppressed_token_ids_until_min_tokens() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[7, 2])
    assert suppressed_token_ids(params, 0, {2}) == [2, 7]
    assert suppressed_token_ids(params, 1, {2}) == [2, 7]
    assert suppressed_token_ids(params, 2, {2}) == []
    ignore = SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[7])
    assert suppressed_token_ids(ignore, 0, {2}) == [7]
