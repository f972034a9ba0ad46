"""EdgeRuntime (torch and ONNX Runtime) equals the engine's full model after layer k-1, reads
only the weights it needs, and rejects bad input without losing its sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edge import EdgeRuntime
from edge.loader import edge_tensor_names, split_fingerprint
from edge.onnx_runtime import OnnxEdgeRuntime
from hetero_pd.models.loader import ModelLoadError

PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33]
DECODE = [279, 7, 400, 12]
# (model dir, prompt, decode tokens, end layer) -> the engine's hidden states (conftest.py)
Reference = Callable[[Path, Sequence[int], Sequence[int], int], torch.Tensor]


def run_sequence(rt: EdgeRuntime) -> torch.Tensor:
    outs = [rt.prefill(PROMPT)]
    outs += [rt.step(t) for t in DECODE]
    return torch.cat(outs)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_torch_edge_equals_full_model(
    request: pytest.FixtureRequest, reference: Reference, family: str, split: int
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{family}_dir")
    rt = EdgeRuntime(path, split, max_positions=64)
    got = run_sequence(rt)
    want = reference(path, PROMPT, DECODE, split)
    assert got.shape == (len(PROMPT) + len(DECODE), rt.hidden_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert rt.num_tokens == len(PROMPT) + len(DECODE)
    # A new prompt starts from an empty cache: same answer again.
    torch.testing.assert_close(rt.prefill(PROMPT), want[: len(PROMPT)], rtol=0, atol=1e-5)


def test_extend_in_chunks_equals_one_prefill(tiny_llama_dir: Path) -> None:
    rt = EdgeRuntime(tiny_llama_dir, 2, max_positions=64)
    whole = rt.prefill(PROMPT)
    rt.reset()
    parts = torch.cat([rt.extend(PROMPT[:4]), rt.extend(PROMPT[4:9]), rt.extend(PROMPT[9:])])
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_onnx_edge_equals_torch_edge(
    request: pytest.FixtureRequest, tmp_path: Path, family: str
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{family}_dir")
    torch_rt = EdgeRuntime(path, 2, max_positions=64)
    onnx_rt = OnnxEdgeRuntime(path, 2, max_positions=64, onnx_path=tmp_path / "e.onnx")
    assert onnx_rt.session.get_providers()[0] == "CPUExecutionProvider"
    torch.testing.assert_close(run_sequence(onnx_rt), run_sequence(torch_rt), rtol=0, atol=1e-4)
    torch.testing.assert_close(onnx_rt.past_k, torch_rt.past_k, rtol=0, atol=1e-4)
    torch.testing.assert_close(onnx_rt.past_v, torch_rt.past_v, rtol=0, atol=1e-4)


def test_onnx_export_is_reused_only_for_the_same_split(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    file = tmp_path / "e.onnx"
    first = OnnxEdgeRuntime(tiny_qwen2_dir, 2, max_positions=64, onnx_path=file)
    want = run_sequence(first)
    stamp = file.stat().st_mtime_ns
    again = OnnxEdgeRuntime(tiny_qwen2_dir, 2, max_positions=64, onnx_path=file)
    assert file.stat().st_mtime_ns == stamp
    torch.testing.assert_close(run_sequence(again), want, rtol=0, atol=0)
    other = OnnxEdgeRuntime(tiny_qwen2_dir, 1, max_positions=64, onnx_path=file)
    assert file.stat().st_mtime_ns != stamp and other.past_k.shape[0] == 1
    assert other.prefill(PROMPT).shape == (len(PROMPT), other.hidden_size)
    file.write_bytes(b"not onnx")  # a damaged file is exported over, not trusted
    assert (
        OnnxEdgeRuntime(tiny_qwen2_dir, 1, max_positions=64, onnx_path=file).step(3).shape[0] == 1
    )


def test_onnx_temporary_export_is_removed_on_close(tiny_llama_dir: Path) -> None:
    rt = OnnxEdgeRuntime(tiny_llama_dir, 1, max_positions=32)
    assert rt.onnx_path.is_file()
    rt.close()
    assert not rt.onnx_path.exists()


def test_onnx_dynamo_exporter(tiny_llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    rt = OnnxEdgeRuntime(tiny_llama_dir, 2, max_positions=64, dynamo=True)
    want = run_sequence(EdgeRuntime(tiny_llama_dir, 2, max_positions=64))
    torch.testing.assert_close(run_sequence(rt), want, rtol=0, atol=1e-4)


def test_loads_only_the_edge_layers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A folder holding only embeddings and layer 0 is enough for split 1, not for split 2."""
    with safe_open(str(tiny_llama_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        kept = {n: f.get_tensor(n) for n in edge_tensor_names(names, 1)}
    assert not any(n.startswith(("model.layers.1.", "model.layers.2.", "lm_head")) for n in kept)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    save_file(kept, str(tmp_path / "model.safetensors"))
    rt = EdgeRuntime(tmp_path, 1, max_positions=64)
    full = EdgeRuntime(tiny_llama_dir, 1, max_positions=64)
    torch.testing.assert_close(rt.prefill(PROMPT), full.prefill(PROMPT), rtol=0, atol=0)
    with pytest.raises(ModelLoadError, match=r"layers \[0, 2\)"):
        EdgeRuntime(tmp_path, 2)


def test_bad_input_is_rejected_and_keeps_the_sequence(tiny_llama_dir: Path) -> None:
    rt = EdgeRuntime(tiny_llama_dir, 1, max_positions=16)
    rt.prefill(PROMPT)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.step(10_000)
    with pytest.raises(ValueError, match="max_positions=16"):
        rt.extend(list(range(6)))
    with pytest.raises(ValueError, match="at least one token"):
        rt.prefill([])
    assert rt.num_tokens == 0  # prefill([]) reset first: it starts a new sequence
    with pytest.raises(ValueError, match=r"split layer 3 must be in \[1, 2\]"):
        EdgeRuntime(tiny_llama_dir, 3)


def test_fingerprint_tells_models_and_splits_apart(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    fp = split_fingerprint(tiny_llama_dir, 1)
    assert fp == EdgeRuntime(tiny_llama_dir, 1).fingerprint()
    assert fp != split_fingerprint(tiny_llama_dir, 2)
    assert fp != split_fingerprint(tiny_qwen2_dir, 1)


def test_tokenizer_stays_on_the_device(tiny_llama_dir: Path) -> None:
    rt = EdgeRuntime(tiny_llama_dir, 1)
    ids = rt.tokenize("Hello edge")
    assert ids and rt.tokenizer.decode(ids, skip_special_tokens=True) == "Hello edge"
