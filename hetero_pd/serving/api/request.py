"""One validated OpenAI request, as the API hands it to the router."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.api.tools import ToolPlan

RequestKind = Literal["completion", "chat"]


@dataclass(slots=True)
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions request.

    Exactly one of ``prompt``, ``prompt_token_ids`` (completions) or ``messages`` (chat)
    is set. ``priority``: lower is served first; 0 (interactive) by default, as in vLLM.
    """

    kind: RequestKind
    model: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    #: Completions: the answer starts with the prompt (and its logprobs, with ``logprobs``).
    echo: bool = False
    echo_text: str = ""  # the prompt's text, set once it is tokenized (with ``echo``)
    #: A batch of several completion prompts (``prompt``/``prompt_token_ids`` are the first).
    batch: list[tuple[str | None, list[int] | None]] = field(default_factory=list)
    include_usage: bool = False
    priority: int = 0
    user: str | None = None
    #: Chat: the tools the answer may call, and how (None: a plain answer).
    tools: ToolPlan | None = None
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "cmpl" if self.kind == "completion" else "chatcmpl"
            self.request_id = f"{prefix}-{uuid.uuid4().hex}"

    def each_prompt(self) -> list[GenerateRequest]:
        """One request per prompt of a batch (``[self]`` without one): its choices are
        ``n`` for each prompt in turn, as vLLM numbers them."""
        if not self.batch:
            return [self]
        return [
            dataclasses.replace(self, prompt=text, prompt_token_ids=ids, batch=[])
            for text, ids in self.batch
        ]
