"""Per-worker KV formats in deployment files: dtype per worker group or per role,
`dtype: auto` (resolved by each worker's backend), and the KV layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends import get_backend
from hetero_pd.deploy.formats import role_dtype, worker_format, worker_formats
from hetero_pd.deploy.launcher import worker_configs
from hetero_pd.deploy.plan import resolve
from hetero_pd.deploy.schema import ConfigError, load_deployment
from hetero_pd.deploy.validate import validate_file


def _workers(write_yaml: Callable[[str], Path], model: Path, top: str = "float32") -> Path:
    return write_yaml(
        f"""
        model: {model}
        dtype: {top}
        workers:
          - {{role: prefill, dtype: bfloat16, kv_layout: fractal_nz}}
          - {{role: decode, count: 2}}
          - {{role: decode, dtype: float16}}
        engine: {{num_threads: 1}}
        """
    )


def test_workers_list_sets_dtype_and_layout_per_group(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    dep = load_deployment(_workers(write_yaml, tiny_llama_dir))
    formats = {worker_id: (f.dtype, f.kv_layout) for worker_id, f in worker_formats(dep).items()}
    assert formats == {
        "prefill-0": ("bfloat16", "fractal_nz"),
        "decode-0": ("float32", "auto"),
        "decode-1": ("float32", "auto"),
        "decode-2": ("float16", "auto"),
    }
    engines = {c.worker_id: c.engine for c in worker_configs(dep)}
    assert engines["prefill-0"].dtype == "bfloat16"
    assert engines["prefill-0"].kv_layout_choice() == "fractal_nz"
    assert engines["decode-1"].dtype == "float32" and engines["decode-1"].kv_layout == "auto"
    assert engines["decode-2"].dtype == "float16"
    assert role_dtype(dep, "prefill") == "bfloat16" and role_dtype(dep, "decode") == "float32"


def test_validate_prints_each_workers_format(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    summary = validate_file(_workers(write_yaml, tiny_llama_dir)).summary()
    assert "prefill-0    prefill  cpu (bfloat16, KV fractal_nz)" in summary
    assert "decode-2     decode   cpu (float16)" in summary


def test_pd_section_sets_formats_per_role_and_plans(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    path = write_yaml(
        f"""
        model: {tiny_llama_dir}
        dtype: auto
        workload: {{input_len: 64, output_len: 16, rate: 2, ttft_ms: 2000, tpot_ms: 200}}
        pd:
          default_p_rate: 0
          default_d_rate: 0
          prefill_dtype: bfloat16
          prefill_kv_layout: fractal_nz
          decode_dtype: float32
        engine: {{num_threads: 1, max_num_seqs: 16}}
        """
    )
    dep = load_deployment(path)
    assert dep.automatic and role_dtype(dep, "prefill") == "bfloat16"
    resolved, plan = resolve(dep, use_calibration=False)
    assert plan is not None and plan.prefill >= 1 and plan.decode >= 1
    formats = worker_formats(resolved)
    assert formats["prefill-0"].dtype == "bfloat16"
    assert formats["prefill-0"].kv_layout == "fractal_nz"
    assert formats["decode-0"].dtype == "float32" and formats["decode-0"].kv_layout == "auto"


def test_dtype_auto_is_resolved_by_each_workers_backend(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETERO_PD_AUTO_DTYPE")  # the backend's own choice, not the forced one
    dep = load_deployment(_workers(write_yaml, tiny_llama_dir, top="auto"))
    engines = {c.worker_id: c.engine for c in worker_configs(dep)}
    assert engines["decode-0"].dtype == "auto"
    chosen = engines["decode-0"].dtype_choice("float32")
    assert chosen == get_backend("cpu").auto_dtype(torch.device("cpu"), torch.float32)
    assert chosen.reason.startswith("auto")  # the worker prints it at start (engine line)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("dtype: float8", "dtype"),
        ("workers: [{role: prefill, dtype: int4}, {role: decode}]", "workers[0].dtype"),
        ("workers: [{role: prefill, kv_layout: nz}, {role: decode}]", "workers[0].kv_layout"),
        ("pd: {default_p_rate: 1, default_d_rate: 1, instances: 2, decode_dtype: x}", "pd"),
    ],
)
def test_bad_formats_are_named(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path, line: str, key: str
) -> None:
    extra = "" if line.startswith(("workers", "pd")) else "\nworkers: [{role: both}]"
    with pytest.raises(ConfigError) as info:
        load_deployment(write_yaml(f"model: {tiny_llama_dir}\n{line}{extra}\n"))
    assert any(issue.key.startswith(key) for issue in info.value.issues), info.value.issues


def test_a_replica_the_file_does_not_list_gets_its_roles_format(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    """Scaling a Kubernetes role up starts `decode-3`: it runs as the first decode group."""
    dep = load_deployment(_workers(write_yaml, tiny_llama_dir))
    assert worker_format(dep, "decode-3", "decode") == worker_formats(dep)["decode-0"]
    assert worker_format(dep, "prefill-5", "prefill").kv_layout == "fractal_nz"
    assert worker_format(dep, "both-0", "both").dtype == "float32"
