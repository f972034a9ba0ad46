"""Optional adapter for CANN's ``llm_datadist`` (Ascend). UNTESTED: needs an Ascend host.

On an Ascend node whose CANN toolkit ships the ``llm_datadist`` Python package, NPU-to-NPU KV
moves should use it (HCCS / RoCE, device memory registered with the NIC) instead of staging
through the host. This module keeps that path optional: ``llm_datadist`` is imported only when
:func:`open_datadist` is called, and its status codes are translated into ours so callers see
one taxonomy whichever path moved the bytes.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from transfer.config import Role
from transfer.errors import StatusCode, TransferError

#: LLM-DataDist status names (``LLMStatusCode``) -> our codes.
STATUS_MAP: dict[str, StatusCode] = {
    "LLM_SUCCESS": StatusCode.SUCCESS,
    "LLM_NOT_YET_LINK": StatusCode.NOT_LINKED,
    "LLM_LINK_FAILED": StatusCode.LINK_FAILED,
    "LLM_LINK_BUSY": StatusCode.LINK_FAILED,
    "LLM_WAIT_PROC_TIMEOUT": StatusCode.TIMEOUT,
    "LLM_TIMEOUT": StatusCode.TIMEOUT,
    "LLM_KV_CACHE_NOT_EXIST": StatusCode.KV_CACHE_NOT_EXIST,
    "LLM_REPEAT_REQUEST": StatusCode.REPEAT_REQUEST,
    "LLM_OUT_OF_MEMORY": StatusCode.OUT_OF_MEMORY,
    "LLM_DEVICE_OUT_OF_MEMORY": StatusCode.OUT_OF_MEMORY,
    "LLM_PARAM_INVALID": StatusCode.PARAM_INVALID,
    "LLM_FEATURE_NOT_ENABLED": StatusCode.PARAM_INVALID,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": StatusCode.PARAM_INVALID,
}


def available() -> bool:
    """True when the ``llm_datadist`` package can be imported (without importing it)."""
    return importlib.util.find_spec("llm_datadist") is not None


def to_status(name: str) -> StatusCode:
    """Translate an LLM-DataDist status name; unknown names are INTERNAL."""
    return STATUS_MAP.get(name, StatusCode.INTERNAL)


def open_datadist(role: Role, cluster_id: int) -> Any:
    """Construct ``llm_datadist.LLMDataDist(role, cluster_id)`` (prefill = PROMPT side)."""
    if not available():
        raise TransferError(StatusCode.PARAM_INVALID, "llm_datadist is not installed here")
    mod = importlib.import_module("llm_datadist")
    llm_role = {Role.PREFILL: "PROMPT", Role.DECODE: "DECODER", Role.BOTH: "MIX"}[role]
    return mod.LLMDataDist(getattr(mod.LLMRole, llm_role), cluster_id)
