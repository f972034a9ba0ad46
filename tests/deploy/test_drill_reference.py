"""The drill's single-process reference runs what its pods run."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.deploy.drill_run import reference_config
from hetero_pd.deploy.testing import deployment


def test_the_reference_runs_the_deployments_dtype_not_auto(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods run the deployment's dtype (float32 by default); `LLM` alone resolves `auto`,
    bfloat16 on a CPU with native bf16, and its greedy answers then differ from the pods'."""
    monkeypatch.setenv("HETERO_PD_AUTO_DTYPE", "bfloat16")
    config = reference_config(deployment(tiny_llama_dir), str(tiny_llama_dir))
    assert config.dtype_choice().name == "float32"
    named = reference_config(deployment(tiny_llama_dir, engine={"dtype": "bfloat16"}), "m")
    assert named.dtype == "bfloat16"  # an engine section's dtype wins, as in the pods
