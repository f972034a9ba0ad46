"""Fixtures for the serving tests: the single-process engine as the reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hetero_pd import LLM, SamplingParams


class Reference:
    """`hetero_pd.LLM` over the same model, in float32 as test stacks run (a deployment's
    default dtype): what the stack must answer, token for token."""

    def __init__(self, model: str | Path) -> None:
        self.llm = LLM(
            str(model), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=1
        )

    def texts(self, prompts: list[list[int]], params: SamplingParams) -> list[str]:
        return [o.outputs[0].text for o in self.llm.generate(prompts, params)]


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir: Path) -> Reference:
    return Reference(tiny_llama_dir)


#: ChatML, as the default model's tokenizer has it (the test tokenizer has no template).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(text_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny text model, its tokenizer given a chat template."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat-model") / "model"
    shutil.copytree(text_llama_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder
