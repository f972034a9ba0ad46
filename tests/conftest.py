"""Shared fixtures: the default model (fetched once by `make test`), tiny random models
written with transformers' own save_pretrained, and their transformers references."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Two threads for a serial run; one per process when pytest-xdist runs two side by side on
# two cores (`make test`): two threads each would oversubscribe the CPUs.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# Engines run eager unless a test asks for `compile="on"`: compiling takes a minute or more,
# so only the tests that check the compiled step pay for it (workers inherit this too).
os.environ.setdefault("HETERO_PD_COMPILE", "off")
# Workers fork from a process that imported torch once (deploy/forkserver.py), ~2.9 s of CPU
# less per start; tests of an exec'd worker's /proc/<pid>/environ say `fork_server: false`.
os.environ.setdefault("HETERO_PD_FORK_SERVER", "1")


def _flags_dtype() -> str:
    """What `auto` means on this CPU by its flags alone: the backend's probe confirms bf16
    with a short timing, and on a busy 2-core machine that flips from run to run."""
    from backends.cpuinfo import cpu_flags
    from backends.dtype import FAST_BF16_CPU_FLAGS

    return "bfloat16" if cpu_flags() & FAST_BF16_CPU_FLAGS else "float32"


# `dtype: auto` is forced for the whole run, workers included, so that every process of a
# test resolves it alike: to $HETERO_PD_AUTO_DTYPE where set, else to this CPU's choice by
# its flags. Tests that run `auto` end to end take `auto_dtype` below instead.
os.environ.setdefault("HETERO_PD_AUTO_DTYPE", _flags_dtype())

#: What the tests marked `dtype` force `auto` to, each in turn: an AVX2 machine then
#: catches what only a machine with native bf16 would, and the reverse.
AUTO_DTYPES = ("float32", "bfloat16")


@pytest.fixture(params=AUTO_DTYPES)
def auto_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`dtype: auto` forced to each of AUTO_DTYPES in turn, in this process and in every
    process the test starts (they inherit the environment)."""
    monkeypatch.setenv("HETERO_PD_AUTO_DTYPE", request.param)
    return str(request.param)


#: Session-scoped stacks that several test files only read (tests/serving/conftest.py), and
#: the files whose tests take them: `make test` (`--dist loadfile`) runs those files in one
#: process, so that each stack starts once (`pytest_xdist_make_scheduler` below).
SHARED_STACKS = (
    "tiny_pd_stack",
    "chat_colocated_stack",
    "default_pd_stack",
    "default_colocated_stack",
)
SHARED_STACK_FILES = frozenset(
    f"tests/serving/{name}.py"
    for name in (
        "test_stack",
        "test_api_sampling",
        "test_sampling_stack",
        "test_control_plane",
        "test_tokenize_api",
        "test_embeddings",
        "test_structured_stack",
    )
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked `dtype` depends on what `auto` resolves to: it must take `auto_dtype`.
    A test that takes one of SHARED_STACKS must be in one of SHARED_STACK_FILES."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker("dtype") and "auto_dtype" not in fixtures:
            raise pytest.UsageError(f"{item.nodeid} is marked dtype but does not take auto_dtype")
        path = item.nodeid.split("::")[0]
        if path not in SHARED_STACK_FILES and any(f in fixtures for f in SHARED_STACKS):
            raise pytest.UsageError(
                f"{item.nodeid} takes a shared stack: add {path} to SHARED_STACK_FILES "
                "(tests/conftest.py), or each test process would start it again"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with SHARED_STACK_FILES one unit of work: whole files per process
    (a module's stack starts once), and the files sharing a session's stack together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedStacksTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "shared-stacks" if path in SHARED_STACK_FILES else path

    return SharedStacksTogether(config, log)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer_dir(default_model_dir: Path) -> Path:
    """A folder with the default model's tokenizer files."""
    return default_model_dir


def _save_tiny(
    config: Any,
    model_cls: Any,
    dest: Path,
    tokenizer_src: Path,
    seed: int,
    random_norms: bool = False,
    router_scale: float = 50.0,
    max_shard_size: str | None = None,
) -> Path:
    """`random_norms` draws every RMSNorm weight around 1 (transformers initialises them to
    exactly 1, where a norm weight loaded into the wrong place would go unnoticed), draws
    DeepSeek's score-correction biases (zero at init), and scales MoE routers up
    `router_scale`x: at transformers' init their softmax is near uniform, the 2nd and 3rd
    expert ~1e-5 apart, where even transformers' generate and its own full forward pick
    different experts."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if random_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".gate.weight"):  # a MoE router
                    p.mul_(router_scale)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.uniform_(-0.1, 0.1)
    if max_shard_size is None:
        model.save_pretrained(dest)
    else:
        model.save_pretrained(dest, max_shard_size=max_shard_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, dest / name)
    return dest


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=False, rope_theta=10000.0)
    return _save_tiny(
        config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir, 1
    )


@pytest.fixture(scope="session")
def text_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Llama whose vocabulary covers the default model's tokenizer, so real
    text can be tokenized for it (edge devices tokenize themselves)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=True)
    return _save_tiny(
        config, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-text-llama"), tokenizer_dir, 3
    )


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


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    return _save_tiny(
        config, Qwen2ForCausalLM, tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir, 2
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Qwen3: per-head q/k RMSNorm, and a head_dim (32) that is not hidden / heads (16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)
    return _save_tiny(
        config,
        Qwen3ForCausalLM,
        tmp_path_factory.mktemp("tiny-qwen3"),
        tokenizer_dir,
        seed=4,
        random_norms=True,
    )


#: Eight experts, two per token: routing decides the output.
TINY_MOE = dict(TINY, intermediate_size=96)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Mixtral: every layer a mixture of experts, top-k weights renormalised."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**TINY_MOE, num_local_experts=8, num_experts_per_tok=2)
    dest = tmp_path_factory.mktemp("tiny-mixtral")
    return _save_tiny(config, MixtralForCausalLM, dest, tokenizer_dir, seed=5, random_norms=True)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Qwen3-MoE: q/k norms, top-k weights as the router gives them (norm_topk_prob false),
    and layer 1 a dense MLP (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **TINY_MOE,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    )
    dest = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return _save_tiny(config, Qwen3MoeForCausalLM, dest, tokenizer_dir, seed=6, random_norms=True)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """DeepSeek-V3: MLA with a low-rank q (q_lora_rank), interleaved yarn rope whose mscale
    and mscale_all_dim differ (so cos/sin and the softmax scale are both corrected), 8 routed
    experts in 4 groups of which the best 2 are searched, a shared expert, random
    score-correction biases, layer 0 dense (first_k_dense_replace); saved in shards of
    200 KB (model.safetensors.index.json)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=256,
        mscale=1.0,
        mscale_all_dim=0.8,
    )
    config = DeepseekV3Config(
        **{**TINY_MOE, "num_key_value_heads": 4},  # MLA: transformers needs kv heads = heads
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,
        first_k_dense_replace=1,
        rope_parameters=yarn,
    )
    dest = tmp_path_factory.mktemp("tiny-deepseek-v3")
    return _save_tiny(
        config,
        DeepseekV3ForCausalLM,
        dest,
        tokenizer_dir,
        seed=7,
        random_norms=True,
        router_scale=5.0,
        max_shard_size="200KB",
    )


#: How far a half-precision engine's log-probabilities may stand from transformers' in the
#: same dtype. Both round bfloat16 matmuls, but accumulate in orders that depend on the CPU
#: (oneDNN picks kernels by ISA: AVX2, AVX-512 BF16, AMX) and on the batch's shape, so they
#: agree to rounding, not bit for bit; a real bug (a wrong position, mask or cache slot)
#: moves log-probabilities by far more (measured on the tiny models, bfloat16 on an AVX-512
#: BF16 CPU: at most 0.004 apart; 0.30 with decode attention reading one slot off).
HALF_LOGPROB_TOL = 0.03


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path, torch.dtype], Any]:
    """transformers' model for a folder and dtype, loaded once per session (EOS disabled)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[Path, torch.dtype], Any] = {}

    def load(path: Path, dtype: torch.dtype) -> Any:
        if (path, dtype) not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            # Like ignore_eos: generate past EOS without suppressing it (min_new_tokens would
            # mask EOS out of the logits and so change the greedy choice).
            model.generation_config.eos_token_id = None
            model.config.eos_token_id = None
            cache[path, dtype] = model
        return cache[path, dtype]

    return load


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Callable[[Path, torch.dtype], Any]) -> Callable[..., list[int]]:
    """transformers' greedy `generate` for one prompt: the reference tokens
    (`run(path, prompt, max_new_tokens, dtype=torch.float32)`)."""

    def run(
        path: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
    ) -> list[int]:
        model = hf_model(path, dtype)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == len(prompt) + max_new_tokens
        return out[0, len(prompt) :].tolist()

    return run


@pytest.fixture(scope="session")
def half_greedy_check(hf_model: Callable[[Path, torch.dtype], Any]) -> Callable[..., int]:
    """The greedy criterion for half precision, where exact equality with another
    implementation holds on no CPU in general: `check(path, prompt, output, dtype)` runs
    transformers in `dtype` teacher-forced on the prompt and the engine's own tokens, and
    asserts at every step that the engine's log-probability of its token is within
    HALF_LOGPROB_TOL of transformers', and that where the engine's token is not
    transformers' top-1, the two were tied within that tolerance. Returns the steps where
    the tokens agree exactly (callers assert >= 99% of all steps). `output` is a
    CompletionOutput of a request made with `logprobs >= 0`."""

    def check(path: Path, prompt: list[int], output: Any, dtype: torch.dtype) -> int:
        tokens = list(output.token_ids)
        assert output.logprobs is not None and len(output.logprobs) == len(tokens)
        with torch.inference_mode():
            logits = hf_model(path, dtype)(torch.tensor([prompt + tokens])).logits[0]
        # Row i predicts tokens[i].
        ref = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
        agree = 0
        for i, token in enumerate(tokens):
            ours = output.logprobs[i][token].logprob
            theirs, top = float(ref[i, token]), int(ref[i].argmax())
            where = f"step {i} of prompt {prompt[:8]}...: token {token}, transformers' {top}"
            assert abs(ours - theirs) <= HALF_LOGPROB_TOL, f"{where}: logprob {ours} vs {theirs}"
            margin = float(ref[i, top]) - theirs
            assert margin <= HALF_LOGPROB_TOL, f"{where}, not a near-tie (margin {margin})"
            agree += margin == 0  # its token is (one of) transformers' top-1
        return agree

    return check
