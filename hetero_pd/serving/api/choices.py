"""A request's ``n`` choices, built from the router's ``Output`` messages: the answer body
(``Answer.body``) or, for a stream, the events of each message (``Answer.events``).

Completion ``index`` of the request is choice ``index``. With ``echo`` each choice starts
with the prompt's text (and, with ``logprobs``, its positions: the worker sends them once,
on completion 0's first output, and every choice shows them). Usage counts the prompt once
and the tokens of every choice, as OpenAI does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hetero_pd.outputs import PromptLogprobs
from hetero_pd.serving.api.logprobs import (
    CompletionLogprobs,
    Decode,
    Entry,
    chat_logprobs,
    prompt_completion_logprobs,
)
from hetero_pd.serving.api.responses import chat_chunk, choices_body, completion_chunk
from hetero_pd.serving.api.tool_stream import PARSERS, CallReader, parse_tool_calls
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control.protocol import Output

if TYPE_CHECKING:
    from hetero_pd.serving.api.request import GenerateRequest


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    finish: str = "abort"
    tokens: int = 0
    started: bool = False  # a stream sent its first event
    calls: CallReader | None = None  # a stream with tools: its reader of calls
    offset: int = 0  # a stream's text_offset of the next token


class Answer:
    """The choices of one prompt; ``base`` is the index of its first (``n`` per prompt of a
    batch, in turn)."""

    def __init__(
        self,
        req: GenerateRequest,
        prompt_ids: list[int],
        decode: Decode,
        echo_text: str = "",
        base: int = 0,
    ) -> None:
        self.req, self.prompt_ids, self.decode, self.echo_text = req, prompt_ids, decode, echo_text
        self.base = base
        self.chat = req.kind == "chat"
        self.choices = [_Choice() for _ in range(req.params.n)]
        self.prompt: PromptLogprobs | None = None
        self.logprobs = req.params.logprobs is not None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def finish(self) -> str:
        """The first choice's reason, or the first that is neither "stop" nor "length"."""
        odd = [c.finish for c in self.choices if c.finish not in ("stop", "length")]
        return odd[0] if odd else self.choices[0].finish

    def add(self, msg: Output) -> list[Entry]:
        """Takes one message; returns its tokens' positions (none without logprobs)."""
        if msg.prompt_logprobs is not None:
            self.prompt = W.prompt_entries(msg.prompt_logprobs)
        c = self.choices[msg.index]
        entries = W.entries(msg.logprobs) if msg.logprobs is not None else []
        c.text.append(msg.text)
        c.entries += entries
        c.tokens = msg.completion_tokens
        if msg.finish_reason is not None:
            c.finish = msg.finish_reason
        return entries

    # -- a whole answer ------------------------------------------------------------------------
    def body(self, prompt_tokens: int) -> dict[str, Any]:
        return choices_body(self.req, self.choices_json(), prompt_tokens, self.completion_tokens)

    def choices_json(self) -> list[dict[str, Any]]:
        return [self._choice(self.base + i, c) for i, c in enumerate(self.choices)]

    def _choice(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        logprobs: dict[str, Any] | None = None
        if self.chat:
            if self.logprobs:
                logprobs = chat_logprobs(self.decode, c.entries, self.req.params.logprobs or 0)
            message, finish = self._message(text, c.finish)
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish}  # fmt: skip
        if self.logprobs:
            lp = self._completion_logprobs()
            lp.add(c.entries)
            logprobs = lp.to_json()
        text = self.echo_text + text if self.req.echo else text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish}

    def _message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """A chat choice's message and finish reason: with tools, the calls in its text
        (``finish_reason`` "tool_calls" when it has any and ended by itself)."""
        if self.req.tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_tool_calls(text, self.req.tools.parser)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return message, "tool_calls" if finish == "stop" else finish

    def _tool_events(self, msg: Output) -> list[dict[str, Any]]:
        """A stream with tools: content as it comes, then each call as it is read (its
        index, id and name, then fragments of its arguments), as OpenAI streams them."""
        c = self.choices[msg.index]
        self.add(msg)
        if c.calls is None:
            assert self.req.tools is not None
            c.calls = PARSERS[self.req.tools.parser]()
        index = self.base + msg.index
        content, deltas = c.calls.feed(msg.text)
        if msg.finish_reason is not None:
            content += c.calls.finish()
        out = []
        if content:
            out.append(chat_chunk(self.req, content, index=index))
        if deltas:
            calls = [d.to_json() for d in deltas]
            out.append(chat_chunk(self.req, None, index=index, tool_calls=calls))
        if msg.finish_reason is not None:
            finish = "tool_calls" if c.calls.started and c.finish == "stop" else c.finish
            out.append(chat_chunk(self.req, None, finish_reason=finish, index=index))
        return out

    def _completion_logprobs(self) -> CompletionLogprobs:
        if self.req.echo and self.prompt is not None:
            return prompt_completion_logprobs(self.decode, self.prompt_ids, self.prompt)
        lp = CompletionLogprobs(self.decode)
        lp.offset = len(self.echo_text) if self.req.echo else 0
        return lp

    # -- a stream ------------------------------------------------------------------------------
    def first_events(self) -> list[dict[str, Any]]:
        """What a chat stream sends before the first token: each choice's role."""
        if not self.chat:
            return []
        return [
            chat_chunk(self.req, "", role="assistant", index=self.base + i)
            for i in range(len(self.choices))
        ]

    def events(self, msg: Output) -> list[dict[str, Any]]:
        """The chunks of one message: its text with its tokens' logprobs, then (when the
        choice ended) its finish reason."""
        if self.chat and self.req.tools is not None:
            return self._tool_events(msg)
        c = self.choices[msg.index]
        entries = self.add(msg)
        finish = msg.finish_reason
        index = self.base + msg.index
        text, lp = msg.text, None
        if not self.chat:
            first = not c.started
            if self.logprobs:
                lp = self._completion_logprobs() if first else CompletionLogprobs(self.decode)
                if not first:
                    lp.offset = c.offset
                lp.add(entries)
                c.offset = lp.offset
            if first and self.req.echo:
                text = self.echo_text + text
        c.started = True
        out = []
        if text or finish is None or entries:
            if self.chat:
                chat_lp = chat_logprobs(self.decode, entries, self.req.params.logprobs or 0)
                out.append(chat_chunk(self.req, text, index=index,
                                      logprobs=chat_lp if self.logprobs else None))  # fmt: skip
            else:
                body = lp.to_json() if lp is not None else None
                out.append(completion_chunk(self.req, text, index=index, logprobs=body))
        if finish is not None:
            out.append(
                chat_chunk(self.req, None, finish_reason=finish, index=index)
                if self.chat
                else completion_chunk(self.req, "", finish, index=index)
            )
        return out


class Batch:
    """The answers of a request's prompts (one, or a completions batch), and their streams
    merged in arrival order."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers

    @property
    def prompt_tokens(self) -> int:
        return sum(len(a.prompt_ids) for a in self.answers)

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    @property
    def finish(self) -> str:
        odd = [a.finish for a in self.answers if a.finish not in ("stop", "length")]
        return odd[0] if odd else self.answers[0].finish

    def body(self) -> dict[str, Any]:
        choices = [c for a in self.answers for c in a.choices_json()]
        req = self.answers[0].req
        return choices_body(req, choices, self.prompt_tokens, self.completion_tokens)

    def first_events(self) -> list[dict[str, Any]]:
        return [e for a in self.answers for e in a.first_events()]

    async def merge(
        self, streams: Sequence[AsyncIterator[Output]]
    ) -> AsyncGenerator[tuple[Answer, Output], None]:
        """Each stream's messages with their answer, as they come; the first error ends it
        (the caller then closes every stream, which aborts their requests)."""
        if len(streams) == 1:
            async for msg in streams[0]:
                yield self.answers[0], msg
            return
        queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[Output]) -> None:
            try:
                async for msg in stream:
                    await queue.put((i, msg))
                await queue.put((i, None))
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self.answers[i], item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
