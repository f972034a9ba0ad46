"""Tool calls read as the answer's text arrives, in vLLM's ``--tool-call-parser`` formats
(``PARSERS``: ``hermes``, and ``llama3_json`` and ``mistral``, whose calls are bare JSON
objects after a marker: ``JsonCallsStream``). Hermes' (vLLM's ``hermes`` parser, streamed):
content is passed on until the first ``<tool_call>``; inside a call, the call starts (index,
id and name in one delta) as soon as its ``"name"`` string is whole, and its ``arguments``
object follows in fragments, each the raw text the model wrote since the last one::

    Sure.<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>
    ─────            ──────────────────────────────  ───────  ──────  ──
    content          start: index 0, id, "add"       fragments of the arguments

The whole answer is parsed by the same reader (``parse_tool_calls``), so a stream's calls
reassemble to the non-streamed ones. What a stream cannot take back: a call whose name was
sent is a call even if its body then fails to parse (cut by ``max_tokens``, or malformed);
the whole answer drops such a call. Text after the first call is not content (Hermes'
answers put it before). If the answer ends with no call started, the text held since the
first ``<tool_call>`` is sent as content, as the whole answer would show it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,?\s*')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class CallDelta:
    """One piece of a streamed call: the first carries ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        fn = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": fn}


@dataclass(slots=True)
class _Braces:
    """Where a JSON value that opens with a brace or bracket ends, read character by
    character (strings and their escapes skipped)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def closes(self, ch: str) -> bool:
        """Reads ``ch``; True when it closes the outermost brace or bracket."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


@dataclass(slots=True)
class _Call:
    index: int
    body: str = ""  # the text since <tool_call>
    id: str | None = None  # set once the name is sent
    name: str = ""
    name_end: int = 0  # where the name's string ends in body
    args_at: int = -1  # where the arguments value starts in body, once known
    scanned: int = 0  # body[args_at:args_at + scanned] has been read
    begun: bool = False  # the arguments' "{" was read
    args: _Braces = field(default_factory=lambda: _Braces())
    whole: _Braces = field(default_factory=lambda: _Braces())  # the call's own object
    args_done: bool = False
    sent: list[str] = field(default_factory=list)  # the arguments' fragments sent


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class CallReader:
    """Reads one choice's answer delta by delta: ``feed`` returns the content and call
    pieces the new text completes, ``finish`` what the end of the answer releases. Each
    format (a subclass) finds its calls' JSON objects; reading them is shared."""

    def __init__(self) -> None:
        self.buf = ""  # text not yet read (a possible tag start, held)
        self.held = ""  # content's trailing whitespace, sent only when more content follows
        self.raw = ""  # the text since the first <tool_call> (content if no call starts)
        self.call: _Call | None = None
        self.calls: list[tuple[str, str, str]] = []  # whole, valid calls: (id, name, arguments)
        self.started = 0  # calls whose start was sent
        self.opened = False  # a <tool_call> was seen: no more content

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> str:
        """The content the end releases: held whitespace, or (no call started) the text
        held since the first ``<tool_call>``."""
        if self.started:
            return ""
        return self.held + (self.raw if self.opened else self.buf)

    def _content(self, text: str) -> str:
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept) :]
        return kept

    def _read(self, call: _Call, body: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        if call.id is None:
            m = _NAME.match(body)
            if m is None:
                return out
            try:
                call.name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            call.id, call.name_end = f"call_{uuid.uuid4().hex[:24]}", m.end()
            self.started += 1
            out.append(CallDelta(call.index, id=call.id, name=call.name))
        if call.args_at < 0:
            args = _ARGS.search(body, call.name_end)
            call.args_at = args.end() if args is not None else -1
        if call.args_at >= 0 and not call.args_done:
            piece = self._scan(call, body[call.args_at + call.scanned :])
            if piece:
                call.sent.append(piece)
                out.append(CallDelta(call.index, piece))
        return out

    def _scan(self, call: _Call, text: str) -> str:
        """The part of ``text`` that belongs to the arguments object (the JSON it opens
        ends where its braces balance)."""
        start = 0
        for k, ch in enumerate(text):
            call.scanned += 1
            if not call.begun:
                if ch.isspace():
                    start = k + 1
                    continue
                if ch != "{":
                    call.args_done = True  # not an object: sent whole at the close
                    return ""
                call.begun = True
            if call.args.closes(ch):
                call.args_done = True
                return text[start : k + 1]
        return text[start:]

    def _close(self, call: _Call, body: str) -> list[CallDelta]:
        """A call's end: kept when its body parses; arguments not sent as fragments (not an
        object, or after the close) go now, whole."""
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return []
        args = parsed.get("arguments", parsed.get("parameters", {}))
        out = []
        if call.id is None:  # the name was not first: the call goes whole
            call.id, call.name = f"call_{uuid.uuid4().hex[:24]}", parsed["name"]
            self.started += 1
            out.append(CallDelta(call.index, id=call.id, name=call.name))
        if call.sent:
            arguments = "".join(call.sent)
        else:
            arguments = json.dumps(args)
            out.append(CallDelta(call.index, arguments))
        self.calls.append((call.id, call.name, arguments))
        return out


class HermesStream(CallReader):
    """Hermes (Qwen): calls in ``<tool_call>`` ... ``</tool_call>``, content before them."""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        if self.opened:
            self.raw += text
        self.buf += text
        while self.buf:
            if self.call is None:
                i = self.buf.find(OPEN)
                cut = i if i >= 0 else len(self.buf) - _held_prefix(self.buf, OPEN)
                if not self.opened:
                    content.append(self._content(self.buf[:cut]))
                if i < 0:
                    self.buf = self.buf[cut:]
                    break
                if not self.opened:
                    self.opened, self.raw = True, self.buf[i:]
                self.call, self.buf = _Call(self.started), self.buf[i + len(OPEN) :]
            else:
                call = self.call
                call.body += self.buf
                self.buf = ""
                j = call.body.find(CLOSE)
                body = call.body if j < 0 else call.body[:j]
                deltas += self._read(call, body)
                if j < 0:
                    break
                deltas += self._close(call, body)
                self.buf, self.call = call.body[j + len(CLOSE) :], None
        return "".join(content), deltas


class JsonCallsStream(CallReader):
    """Calls as bare JSON objects after a marker, with separators between them:
    Llama 3's (``llama3_json``: the answer is ``<|python_tag|>`` or ``{`` first, calls
    ``{"name", "parameters"}`` joined by ``;``) and Mistral's (``mistral``: content, then
    ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``)."""

    SEPARATORS = " \t\n;,[]"

    def __init__(self, marker: str, first: bool) -> None:
        super().__init__()
        self.marker = marker
        self.first = first  # calls only when the answer begins with them (Llama 3)
        self.plain = False  # the answer is content only
        self.ended = False  # something other than a call came after the calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content = ""
        deltas: list[CallDelta] = []
        if self.opened:
            self.raw += text
        self.buf += text
        while self.buf and not self.plain and not self.ended:
            if not self.opened:
                got, found = self._find_start()
                content += got
                if not found:
                    break
            elif self.call is None:
                rest = self.buf.lstrip(self.SEPARATORS)
                self.buf = rest
                if rest and rest[0] != "{":
                    self.ended = True
                elif rest:
                    self.call = _Call(self.started)
            else:
                call, end = self.call, -1
                for k, ch in enumerate(self.buf):
                    if call.whole.closes(ch):
                        end = k + 1
                        break
                call.body += self.buf if end < 0 else self.buf[:end]
                self.buf = "" if end < 0 else self.buf[end:]
                deltas += self._read(call, call.body)
                if end >= 0:
                    deltas += self._close(call, call.body)
                    self.call = None
        if self.plain:
            content, self.buf = content + self.buf, ""
        return content, deltas

    def _find_start(self) -> tuple[str, bool]:
        """(content before the calls, whether they start here); the buffer keeps what may
        still begin the marker."""
        if self.first:
            head = self.buf.lstrip()
            if head.startswith(self.marker) or head.startswith("{"):
                body = head[len(self.marker) :] if head.startswith(self.marker) else head
                self.opened, self.raw, self.buf = True, self.buf, body
                return "", True
            if not head or self.marker.startswith(head):
                return "", False  # too early to tell
            self.plain = True
            return "", False
        i = self.buf.find(self.marker)
        cut = i if i >= 0 else len(self.buf) - _held_prefix(self.buf, self.marker)
        content = self._content(self.buf[:cut])
        if i < 0:
            self.buf = self.buf[cut:]
            return content, False
        self.opened, self.raw = True, self.buf[i:]
        self.buf = self.buf[i + len(self.marker) :]
        return content, True


#: Readers by vLLM's ``--tool-call-parser`` names.
PARSERS: dict[str, Callable[[], CallReader]] = {
    "hermes": HermesStream,
    "llama3_json": lambda: JsonCallsStream("<|python_tag|>", first=True),
    "mistral": lambda: JsonCallsStream("[TOOL_CALLS]", first=False),
}


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """The calls in a whole answer, in ``parser``'s format: ``(content before the first
    call or None, calls in OpenAI's shape)``; no calls when none parses (the whole text is
    content)."""
    reader = PARSERS[parser]()
    content, _ = reader.feed(text)
    reader.finish()
    calls = [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, name, args in reader.calls
    ]
    if not calls:
        return text, []
    return content.strip() or None, calls
