"""Prefill on one engine, the prompt's KV over TCP through the int8 codec, decode on another:
the decode engine's blocks hold exactly the codec's image of the prefill engine's, and its
greedy tokens stay transformers' (the model's answers survive the codec). For K/V heads
(Llama) and MLA's latent rows (DeepSeek-V3: one c_kv | k_pe row a token, one scale each)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetero_pd.config import EngineConfig
from hetero_pd.engine.kv_codec_agreement import token_agreement
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.sampling_params import SamplingParams
from transfer import KVRegion, TransferConfig, TransferEngine, TransferState
from transfer.kv_codec import decode, encode

PROMPT = [(7 * i + 11) % 500 + 1 for i in range(45)]  # 3 blocks of 16, the last partial


class Side:
    """An LLMEngine whose KV cache is a transfer region of its own TransferEngine."""

    def __init__(self, name: str, role: str, model: Path, codec: str) -> None:
        cfg = TransferConfig(secret=b"codec-test", transports=("tcp",), kv_codec=codec)
        self.transfer = TransferEngine(name, role, cfg)
        self.region: KVRegion | None = None
        engine_cfg = EngineConfig.from_kwargs(
            str(model), dtype="float32", role=role, block_size=16, num_kv_blocks=32, max_num_seqs=2
        )
        self.engine = LLMEngine(engine_cfg, kv_allocator=self._allocate)
        assert self.region is not None
        self.transfer.register_region(self.region)

    def _allocate(
        self, layers: int, blocks: int, shape: Any, dtype: Any, device: Any, per_layer: int
    ) -> Any:
        self.region = KVRegion.allocate(
            "kv", layers, blocks, shape, dtype, device=device, tensors_per_layer=per_layer
        )
        return self.region.tensors

    def close(self) -> None:
        self.engine.close()
        self.transfer.close()


@pytest.fixture
def pd_pair() -> Iterator[Callable[[str, Path], tuple[Side, Side]]]:
    made: list[Side] = []

    def build(codec: str, model: Path) -> tuple[Side, Side]:
        p = Side(f"prefill-{codec}", "prefill", model, codec)
        d = Side(f"decode-{codec}", "decode", model, codec)
        made.extend((p, d))
        p.transfer.link(d.transfer.engine_id, d.transfer.address)
        return p, d

    try:
        yield build
    finally:
        for side in made:
            side.close()


def _disaggregated(p: Side, d: Side, max_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """One request prefilled on ``p`` and decoded on ``d``: (its tokens, p's blocks, d's)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dst = d.engine.add_remote_request(PROMPT, params, "r")
    recv = d.transfer.reserve("r", dst, writer=p.transfer.engine_id, timeout_s=60)
    assert recv.blocks is not None
    p.engine.add_request(PROMPT, params, request_id="r")
    first: int | None = None
    while first is None:
        for out in p.engine.step():
            first = out.outputs[0].token_ids[0]
    src, num_tokens = p.engine.held_blocks("r")
    push = p.transfer.push_blocks(d.transfer.engine_id, src, recv.blocks, num_tokens=num_tokens)
    assert push.wait(60) is TransferState.DONE, push.error
    assert recv.wait(60) is TransferState.DONE
    p.engine.release_held("r")
    d.engine.remote_kv_ready("r", first)
    tokens: list[int] = []
    while d.engine.has_unfinished_requests():
        for out in d.engine.step():
            tokens = out.outputs[0].token_ids
    return tokens, src, list(dst)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_deepseek_v3_dir"])
def test_int8_kv_between_engines_keeps_the_greedy_tokens(
    model_fixture: str,
    request: pytest.FixtureRequest,
    pd_pair: Callable[[str, Path], tuple[Side, Side]],
    hf_greedy: Callable[..., list[int]],
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    p, d = pd_pair("int8", model)
    tokens, src, dst = _disaggregated(p, d, max_tokens=8)
    assert p.region is not None and d.region is not None
    shape = tuple(p.region.block_shape)
    for sent, got in zip(p.region.tensors, d.region.tensors, strict=True):
        want = decode(encode(sent[src]), len(src), shape, torch.float32)
        n = len(PROMPT)  # decode has since written its own tokens' KV after the prompt's
        landed = got[dst].flatten(0, 1)[:n]
        assert torch.equal(landed, want.flatten(0, 1)[:n])  # the codec's image, not raw KV
        assert not torch.equal(landed, sent[src].flatten(0, 1)[:n])
    wire = p.transfer.metrics().transport("tcp").bytes_sent_total
    raw = len(src) * p.region.block_bytes * len(p.region.tensors)
    assert wire == len(encode(p.region.tensors[0][src])) * len(p.region.tensors)
    assert wire / raw == pytest.approx((1 + 4 / shape[-1]) / 4)  # int8 + a float32 per head
    assert tokens == hf_greedy(model, PROMPT, 8)


def test_teacher_forced_agreement_of_int8_kv_on_a_tiny_model(tiny_llama_dir: Path) -> None:
    seqs = [[(13 * i + k) % 500 + 1 for i in range(40)] for k in range(3)]
    raw = token_agreement(str(tiny_llama_dir), seqs, "none")
    assert (raw.positions, raw.rate) == (60, 1.0)  # the same KV: the same tokens
    coded = token_agreement(str(tiny_llama_dir), seqs, "int8")
    assert coded.positions == 60 and coded.rate >= 0.95
