"""SSE decoding and chunk timing, fed synthetic bytes and timestamps (no network)."""

from __future__ import annotations

import json

import pytest

from hetero_pd.bench.client import SSEDecoder, StreamTimer, base_url, build_payload
from hetero_pd.bench.datasets import BenchRequest

REQ = BenchRequest("hello", 1, 8)


def data(obj: object) -> str:
    return json.dumps(obj)


def test_sse_decoder_handles_split_lines_crlf_and_comments() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\r\n\r\n: ping\n\nevent: x\ndata:[DONE]\n") == ['{"a": 1}', "[DONE]"]
    assert d.feed(b"data: tail") == []
    assert d.flush() == ["tail"]
    assert d.flush() == []


def test_completion_timings_from_chunk_timestamps() -> None:
    t = StreamTimer("completions", REQ, start=10.0)
    for text, now in (("a", 10.5), ("b", 10.6), ("", 10.65), ("c", 10.9)):
        assert t.on_message(data({"choices": [{"text": text}]}), now)
    assert t.on_message(data({"choices": [{"text": "", "finish_reason": "length"}]}), 11.0)
    usage = {"prompt_tokens": 3, "completion_tokens": 4}
    assert t.on_message(data({"choices": [], "usage": usage}), 11.2)
    assert t.on_message("[DONE]", 11.3)
    r = t.finish()
    assert r.success
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.3])  # gaps between content chunks only
    assert r.latency == pytest.approx(1.0)  # last chunk with choices
    assert r.output_tokens == 4  # the server's usage wins over the 3 content chunks
    assert r.prompt_tokens == 3
    assert r.generated_text == "abc"
    assert r.tpot == pytest.approx(0.5 / 3)


def test_chat_role_chunk_is_not_the_first_token_and_chunks_count_without_usage() -> None:
    t = StreamTimer("chat", REQ, start=0.0)
    t.on_message(data({"choices": [{"delta": {"role": "assistant"}}]}), 0.01)
    t.on_message(data({"choices": [{"delta": {"content": "hi"}}]}), 0.2)
    t.on_message(data({"choices": [{"delta": {"reasoning_content": "hm"}}]}), 0.25)
    r = t.finish()
    assert r.ttft == pytest.approx(0.2)
    assert r.output_tokens == 2
    assert r.tpot == pytest.approx(0.05)


def test_error_chunk_and_empty_stream_fail() -> None:
    t = StreamTimer("completions", REQ, start=0.0)
    assert not t.on_message(data({"error": {"message": "kv transfer failed"}}), 0.1)
    assert "kv transfer failed" in t.out.error and not t.out.success
    empty = StreamTimer("completions", REQ, start=0.0)
    empty.on_message("[DONE]", 0.1)
    r = empty.finish()
    assert not r.success and "without any content" in r.error
    with pytest.raises(ValueError):
        StreamTimer("completions", REQ, start=0.0).on_message("[1, 2]", 0.1)


def test_payloads_and_urls() -> None:
    body = build_payload("chat", "m", REQ, ignore_eos=True, extra_body={"top_k": 1})
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["top_k"] == 1
    assert build_payload("completions", "m", REQ)["prompt"] == "hello"
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert base_url("http://h:1") == "http://h:1"
