"""The edge layers [0, k) exported to ONNX with their KV cache as explicit inputs and outputs,
run with ONNX Runtime (CPU, or CUDA where `onnxruntime-gpu` provides it).

Graph signature (dynamic axes named)::

    input_ids [num_tokens] int64, positions [num_tokens] int64,
    past_k, past_v [k, past_len, kv_heads, head_dim]
      -> hidden [num_tokens, hidden], present_k, present_v [k, total_len, kv_heads, head_dim]

Exported by default with torch's TorchScript-based exporter (`dynamo=False`): it needs only
`onnx`, works offline and exports in well under a second for the tiny models. torch 2.13
marks it deprecated; `dynamo=True` (the torch.export-based exporter, which needs
`onnxscript`) is supported too and gives the same hidden states.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.runtime import EdgeRuntime
from edge.stack import EdgeStack
from hetero_pd.extras import require

OPSET = 17
INPUTS = ["input_ids", "positions", "past_k", "past_v"]
OUTPUTS = ["hidden", "present_k", "present_v"]
_FINGERPRINT_KEY = "hetero_pd.edge.fingerprint"


def export_edge_onnx(
    stack: EdgeStack, path: str | Path, fingerprint: str = "", dynamo: bool = False
) -> Path:
    """Writes `stack` (on the CPU, float32) to `path` as ONNX; returns the path.

    `dynamo=True` uses torch's torch.export-based exporter instead (needs `onnxscript`, is
    ~10x slower to export, gives the same graph semantics): the way forward once torch
    drops the TorchScript exporter.
    """
    onnx = require("onnx", "edge", "the edge runtime's ONNX path")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg, k = stack.cfg, stack.split_layer
    past = torch.zeros((k, 2, cfg.num_kv_heads, cfg.head_dim))
    example = (torch.tensor([1, 2, 3]), torch.arange(2, 5), past, past.clone())
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter warns that it is deprecated; it is chosen on purpose.
        warnings.simplefilter("ignore")
        if dynamo:
            from torch.export import Dim

            n = Dim("num_tokens", min=1, max=stack.max_positions)
            p = Dim("past_len", min=0, max=stack.max_positions - 1)
            shapes = ({0: n}, {0: n}, {1: p}, {1: p})
            options: dict[str, Any] = {"dynamic_shapes": shapes}
        else:
            tokens, total = {0: "num_tokens"}, {1: "total_len"}
            axes = {"input_ids": tokens, "positions": tokens, "hidden": tokens}
            axes |= {"past_k": {1: "past_len"}, "past_v": {1: "past_len"}}
            axes |= {"present_k": total, "present_v": total}
            options = {"dynamic_axes": axes}
        torch.onnx.export(
            stack,
            example,
            str(path),
            dynamo=dynamo,
            input_names=INPUTS,
            output_names=OUTPUTS,
            opset_version=OPSET if not dynamo else None,
            **options,
        )
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {_FINGERPRINT_KEY: fingerprint})
    onnx.save(model, str(path))
    return path


def default_providers(device: torch.device) -> list[str]:
    """CUDA (then CPU) for a cuda device when onnxruntime-gpu offers it, else CPU only."""
    ort = require("onnxruntime", "edge", "the edge runtime's ONNX path")

    available = ort.get_available_providers()
    if device.type == "cuda" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxEdgeRuntime(EdgeRuntime):
    """`EdgeRuntime` whose layers run in ONNX Runtime; same API, same hidden states (to 1e-4).

    The graph is exported on construction to `onnx_path` (a private temporary folder when
    None). An existing file there is reused only if it was exported for the same model folder
    and split layer (its fingerprint metadata matches); otherwise it is overwritten. `device`
    picks the execution provider ("cuda" uses CUDAExecutionProvider where present); the KV
    cache lives in host memory as numpy arrays.
    """

    backend = "onnx"

    def __init__(
        self,
        model_dir: str | Path,
        split_layer: int,
        *,
        device: str | torch.device = "cpu",
        max_positions: int | None = None,
        onnx_path: str | Path | None = None,
        providers: list[str] | None = None,
        threads: int | None = None,
        dynamo: bool = False,
    ) -> None:
        ort = require("onnxruntime", "edge", "the edge runtime's ONNX path")

        super().__init__(model_dir, split_layer, max_positions=max_positions)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if onnx_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="hetero-pd-edge-")
            onnx_path = Path(self._tmp.name) / "edge.onnx"
        self.onnx_path = Path(onnx_path)
        # The rope table's length is baked into the graph, so it is part of the identity.
        identity = f"{self.fingerprint()}/{self.max_positions}"
        if _stored_fingerprint(self.onnx_path) != identity:
            export_edge_onnx(self.stack, self.onnx_path, identity, dynamo=dynamo)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        chosen = providers or default_providers(torch.device(str(device)))
        self.session = ort.InferenceSession(str(self.onnx_path), options, providers=chosen)
        # The session holds its own copy of the weights: free torch's (shapes stay known).
        self.stack.to("meta")

    def close(self) -> None:
        """Deletes the temporary ONNX file, if this runtime made one."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feeds: dict[str, Any] = {
            "input_ids": input_ids.numpy(),
            "positions": positions.numpy(),
            "past_k": _as_numpy(self.past_k),
            "past_v": _as_numpy(self.past_v),
        }
        hidden, present_k, present_v = self.session.run(OUTPUTS, feeds)
        return torch.from_numpy(hidden), torch.from_numpy(present_k), torch.from_numpy(present_v)


def _as_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.detach().cpu().contiguous().numpy()


def _stored_fingerprint(path: Path) -> str | None:
    """The fingerprint an earlier export wrote into the file's metadata (None: no usable file)."""
    if not path.is_file():
        return None
    onnx = require("onnx", "edge", "the edge runtime's ONNX path")
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (OSError, DecodeError):  # unreadable, truncated or not ONNX: export over it
        return None
    return next((p.value for p in model.metadata_props if p.key == _FINGERPRINT_KEY), None)
