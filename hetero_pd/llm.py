"""The offline API, mirroring vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.logprobs import decode_logprobs
from hetero_pd.engine.parallel_sampling import ParentRequest
from hetero_pd.models.fetch import DEFAULT_MODEL
from hetero_pd.outputs import RequestOutput
from hetero_pd.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a known model name (default `smollm2-135m-instruct`, fetched on first use) or
            the path of a local Hugging Face folder (llama, mistral or qwen2 architecture).
        device: "cpu", "cuda[:N]" or "npu[:N]".
        dtype: "auto" (bfloat16 where the device has native bf16 matmuls, else float32),
            "float32", "bfloat16" or "float16".
        **kwargs: any other EngineConfig field (max_num_seqs, kv_cache_gb, ...).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "cpu",
        dtype: str = "auto",
        **kwargs: Any,
    ) -> None:
        config = EngineConfig.from_kwargs(model, device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(config)
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string or a list of token ids), all in one batch;
        returns the outputs in prompt order, each with ``n`` completions."""
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        parents: list[ParentRequest] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                parent = ParentRequest(f"gen-{self._next_id}", p)
                self._next_id += 1
                self.engine.add_request(prompt, parent.child_params(0), parent.child_id(0))
                parents.append(parent)
        except BaseException:
            for parent in parents:  # all or nothing: a rejected prompt leaves nothing queued
                self.engine.abort_request(parent.child_id(0))
            raise
        return self._run(parents, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (with the generation prompt) and generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.apply_chat_template(conv)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return chat_prompt_ids(self.engine.tokenizer, messages, self.engine.model_path)

    def _run(self, parents: list[ParentRequest], use_tqdm: bool) -> list[RequestOutput]:
        by_child = {p.child_id(0): p for p in parents}
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(parents), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    parent = by_child[out.request_id]
                    for index in parent.record(out):
                        child = parent.child_id(index)
                        self.engine.add_request(
                            out.prompt_token_ids, parent.child_params(index), child
                        )
                        by_child[child] = parent
                    if parent.finished:
                        final[parent.request_id] = self._finish(parent.output())
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for child in by_child:
                self.engine.abort_request(child)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[p.request_id] for p in parents]

    def _finish(self, out: RequestOutput) -> RequestOutput:
        """Fills in each logprob's token text."""
        tok = self.engine.tokenizer
        if out.prompt_logprobs:
            decode_logprobs(tok, out.prompt_logprobs)
        for completion in out.outputs:
            decode_logprobs(tok, completion.logprobs or [])
        return out


def chat_prompt_ids(tokenizer: Any, messages: list[Message], model: object = "") -> list[int]:
    """The prompt's token ids: the chat template applied with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    batch = list(prompts)
    if not batch:
        raise ValueError("prompts is empty")
    return batch


def _params_for(
    batch: list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * len(batch)
    if isinstance(params, SamplingParams):
        return [params] * len(batch)
    params = list(params)
    if len(params) != len(batch):
        raise ValueError(f"got {len(params)} SamplingParams for {len(batch)} prompts")
    return params
