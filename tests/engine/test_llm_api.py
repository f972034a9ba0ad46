"""The offline API: prompts as text or token ids, batches in order, chat templates, stop
strings and stop tokens, seeded sampling and max_tokens."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.outputs import CompletionOutput

# The tiny models share the default tokenizer but only know token ids < 512: these prompts
# tokenize inside that range.
TEXTS = ["in the", "a b c", "is it"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8)


def completion(llm: LLM, prompt: str | list[int], params: SamplingParams) -> CompletionOutput:
    (out,) = llm.generate(prompt, params)
    assert out.finished
    return out.outputs[0]


def assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.check_integrity()


def test_text_and_token_id_prompts_single_and_batched(llm: LLM) -> None:
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert all(max(p) < 512 for p in ids)
    singles = [completion(llm, t, GREEDY).token_ids for t in TEXTS]

    (one,) = llm.generate(TEXTS[0], GREEDY)
    assert one.prompt == TEXTS[0] and one.prompt_token_ids == ids[0]
    (one,) = llm.generate(ids[0], GREEDY)  # a flat list of ints is one prompt
    assert one.prompt is None and one.prompt_token_ids == ids[0]
    assert one.outputs[0].token_ids == singles[0]

    by_text = llm.generate(TEXTS, GREEDY)
    by_ids = llm.generate(ids, GREEDY)
    assert [o.prompt for o in by_text] == TEXTS
    assert [o.prompt_token_ids for o in by_ids] == ids
    assert [o.outputs[0].token_ids for o in by_text] == singles
    assert [o.outputs[0].token_ids for o in by_ids] == singles
    assert len({o.request_id for o in by_text + by_ids}) == 2 * len(TEXTS)
    assert_clean(llm)


def test_one_sampling_params_per_prompt_in_order(llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 1)]
    outs = llm.generate(TEXTS, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 1]
    assert [o.prompt for o in outs] == TEXTS


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = completion(llm, TEXTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def pick_stop_word(text: str) -> tuple[str, int]:
    """A word of the text whose first occurrence is not at its start: (word, index)."""
    for word in re.findall(r"[A-Za-z]{2,}", text):
        if text.find(word) >= 5:
            return word, text.find(word)
    raise AssertionError(f"no usable stop word in {text!r}")


def test_stop_strings(llm: LLM) -> None:
    full = completion(llm, TEXTS[0], GREEDY)
    word, at = pick_stop_word(full.text)

    out = completion(llm, TEXTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[word]))
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == full.text[:at]
    assert word not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]

    kept = SamplingParams(temperature=0, max_tokens=24, stop=word, include_stop_str_in_output=True)
    out = completion(llm, TEXTS[0], kept)
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == full.text[: at + len(word)]

    never = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["\x00zz"])
    out = completion(llm, TEXTS[0], never)
    assert out.finish_reason == "length" and out.text == full.text
    assert_clean(llm)


def test_stop_token_ids(llm: LLM) -> None:
    full = completion(llm, TEXTS[0], GREEDY).token_ids
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full[k]])
    out = completion(llm, TEXTS[0], params)
    assert out.token_ids == full[: k + 1], "the stop token is kept in token_ids"
    assert out.finish_reason == "stop" and out.stop_reason == full[k]

    # min_tokens bans the stop token until that many tokens exist
    late = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full[0]], min_tokens=4)
    out = completion(llm, TEXTS[0], late)
    assert full[0] not in out.token_ids[:4] and len(out.token_ids) >= 4
    assert (out.finish_reason, out.token_ids[-1] == full[0]) in {("stop", True), ("length", False)}
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = completion(llm, TEXTS[0], seeded).token_ids
    assert completion(llm, TEXTS[0], seeded).token_ids == alone

    others = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
        seeded,
        SamplingParams(temperature=0.7, seed=99, max_tokens=5, ignore_eos=True, top_k=20),
    ]
    outs = llm.generate([TEXTS[1], TEXTS[0], TEXTS[2]], others)
    assert outs[1].outputs[0].token_ids == alone

    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert completion(llm, TEXTS[0], other_seed).token_ids != alone
    assert_clean(llm)


def test_chat_needs_a_template(llm: LLM) -> None:
    if getattr(llm.tokenizer, "chat_template", None):
        pytest.skip("this tokenizer copy has a chat template")
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def test_chat_applies_the_chat_template(chat_model: Path) -> None:
    """The tiny chat model (ChatML, as the default model's tokenizer has it): what is
    checked is our use of the tokenizer's template, not the weights behind it."""
    llm = LLM(str(chat_model), num_kv_blocks=64)
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a color."},
        ],
    ]
    params = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.chat(conversations, params)
    assert len(outs) == 2
    for conv, out in zip(conversations, outs, strict=True):
        assert out.prompt_token_ids == template_ids(llm.tokenizer, conv)
        assert out.outputs[0].token_ids
    # a single conversation is one prompt
    (single,) = llm.chat(conversations[0], params)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_clean(llm)
