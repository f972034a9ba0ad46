"""The sections of a deployment file (schema version 1), one frozen dataclass each.

configs/README.md documents every key; the constraints here are what `validate` enforces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hetero_pd.config import COMPILE_MODES, DTYPE_CHOICES, EngineConfig
from hetero_pd.deploy.fields import opt, required
from hetero_pd.hidden_codec import CODECS as EDGE_CODECS
from hetero_pd.serving.router.policy import FAILURE_POLICIES, POLICIES, RoutingConfig
from hetero_pd.serving.router.policy import MAX_TOKENS_PER_OUTPUT as MAX_PER_OUTPUT
from hetero_pd.serving.router.rebalance import RebalanceConfig
from hetero_pd.serving.router.router import RouterConfig
from transfer import FaultPlan, FaultRule, TransferConfig
from transfer.kv_codec import CODECS as KV_CODECS
from transfer.kv_layouts import LAYOUTS as KV_LAYOUTS

ROLES = ("prefill", "decode", "both")
#: A worker group's dtype: "" = the deployment's `dtype`; "auto" = its device's backend picks.
WORKER_DTYPES = ("", *DTYPE_CHOICES)
#: Byte order of a worker's KV blocks: "auto" = its device's (fractal_nz on npu, else nd).
WORKER_KV_LAYOUTS = ("auto", *KV_LAYOUTS)
TRANSPORTS = ("local", "cuda_ipc", "shm", "tcp")
#: Kubernetes extended resource and node selector of each accelerator kind (overridable).
DEVICE_RESOURCES = {"npu": "huawei.com/Ascend910", "cuda": "nvidia.com/gpu"}
NODE_SELECTORS = {
    "npu": {"accelerator": "ascend-910b"},
    "cuda": {"nvidia.com/gpu.present": "true"},
}
#: What `kubernetes.images` may name: the router's image and one per worker device kind.
IMAGE_KINDS = ("router", "cpu", "cuda", "npu")
#: Host paths an Ascend container needs from its node (the driver, its tools and version
#: file; MindIE/ascend-docker-runtime mount the same), read-only.
ASCEND_HOST_MOUNTS = (
    "/usr/local/Ascend/driver",
    "/usr/local/Ascend/add-ons",
    "/usr/local/dcmi",
    "/usr/local/bin/npu-smi",
    "/etc/ascend_install.info",
)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """`count` workers of one role. A bare accelerator kind (`npu`) gets the next free
    indices; `devices: [cuda:0, cuda:1]` names them (and sets the count)."""

    role: str = required(choices=ROLES)
    device: str = "cpu"
    count: int = opt(1, lo=1, hi=256)
    cpus: tuple[int, ...] = opt((), lo=0)
    devices: tuple[str, ...] = ()
    #: Bare metal: the host (address or name peers reach it by) that runs these workers;
    #: `hetero-pd serve CONFIG --host-id HOST` there starts them. "" = this box.
    host: str = ""
    #: Bare metal: control port of this group's first worker (each next one +2; a worker's
    #: transfer port is its control port + 1). 0: after the host's previous workers, from 9000.
    port: int = opt(0, lo=0, hi=65000)
    #: These workers' compute and KV dtype ("" = the deployment's); KV moving to a worker of
    #: another dtype is converted on receipt.
    dtype: str = opt("", choices=WORKER_DTYPES)
    kv_layout: str = opt("auto", choices=WORKER_KV_LAYOUTS)
    #: Ranks each of these workers splits the model over (one process and one device
    #: each, the first given by `device`); the router sees one worker.
    tensor_parallel_size: int = opt(1, lo=1, hi=64)
    #: Speculative decoding on these workers (vLLM's `speculative_config` keys: method
    #: ngram or draft_model, num_speculative_tokens, prompt_lookup_min/max for ngram,
    #: model (the draft's folder) for draft_model); decode or both workers only.
    speculative_config: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The `engine:` section: the EngineConfig options every worker runs with (its model,
    role, device and tensor_parallel_size come from the deployment's worker groups). Each
    option keeps EngineConfig's name and default, except where "not set" means someone else
    decides: `dtype` "" (the deployment's `dtype`) and `num_threads` / `initial_threads`
    None (the launcher's share of the host's CPUs)."""

    dtype: str = opt("", choices=WORKER_DTYPES, doc='"": the deployment\'s `dtype`')
    kv_layout: str = opt("auto", choices=WORKER_KV_LAYOUTS)
    block_size: int = opt(16, gt=0)
    max_num_seqs: int = opt(64, gt=0)
    max_num_batched_tokens: int = opt(1024, gt=0)
    max_model_len: int | None = opt(None, gt=0, doc="None: the model's limit, at most 4096")
    kv_cache_gb: float = opt(1.0, gt=0)
    num_kv_blocks: int | None = opt(None, gt=0, doc="an exact block count instead of kv_cache_gb")
    enable_prefix_caching: bool = True
    kv_cache_host_gb: float = opt(0.0, lo=0)
    kv_cache_disk_gb: float = opt(0.0, lo=0)
    kv_cache_disk_path: str | None = None
    kv_cache_admit_after: int = opt(2, lo=1)
    num_threads: int | None = opt(None, gt=0)
    initial_threads: int | None = opt(None, gt=0)
    seed: int = 0
    compile: str = opt("auto", choices=COMPILE_MODES)
    start_layer: int = opt(0, lo=0)

    def engine_config(self, model: str, device: str = "cpu", **overrides: Any) -> EngineConfig:
        """One engine's config: `model` on `device` with these options (an unset `dtype`
        leaves EngineConfig's), then `overrides` (what the launcher decides per worker)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not options["dtype"]:
            del options["dtype"]
        return EngineConfig.from_kwargs(model, device=device, **{**options, **overrides})


#: vLLM's --tool-call-parser names served (hetero_pd.serving.api.tool_stream.PARSERS).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class RebalanceSpec:
    """`router.rebalance`: live-migrate decoding requests off a decode worker whose KV usage
    is above `high` to one below `low` (opt-in; `low` < `high`, checked in schema)."""

    enabled: bool = False
    high: float = opt(0.85, lo=0.0, hi=1.0)
    low: float = opt(0.5, lo=0.0, hi=1.0)
    interval_s: float = opt(1.0, gt=0.0, doc="seconds between rounds")
    max_moves: int = opt(2, lo=1, hi=64, doc="requests moved per round")
    cooldown_s: float = opt(3.0, lo=0.0, doc="a pair of workers that moved sits out this long")

    def config(self) -> RebalanceConfig:
        return RebalanceConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """The `router:` section: where the API listens, its keys and limits, and the
    RouterConfig (routing policy, failure policy) under the same names."""

    host: str = "127.0.0.1"
    port: int = opt(8000, lo=0, hi=65535, doc="0: any free port (one box only)")
    policy: str = opt("least_loaded", choices=POLICIES)
    failure_policy: str = opt("recompute", choices=FAILURE_POLICIES)
    api_keys: tuple[str, ...] = ()
    #: API keys whose requests may set `priority` (each also in api_keys); others get 400.
    priority_api_keys: tuple[str, ...] = ()
    #: Keys that operate the deployment over HTTP (/admin/*: drain, migrate, restart). A
    #: client's API key never does: with api_keys set and no admin_keys, /admin/* is off.
    admin_keys: tuple[str, ...] = ()
    max_inflight: int = opt(256, lo=1, doc="completions in flight (prompts x n); above: 429")
    max_inflight_per_key: int = opt(
        0, lo=0, doc="completions in flight per API key; 0: max_inflight / number of keys"
    )
    local_prefill_max_tokens: int = opt(32, lo=0)
    #: vLLM's --tool-call-parser: the format the model writes tool calls in.
    tool_call_parser: str = opt("hermes", choices=TOOL_CALL_PARSERS)
    #: vLLM's --enable-auto-tool-choice (on here by default): off, tool_choice "auto" is a 400.
    enable_auto_tool_choice: bool = True
    elastic_prefill: bool = opt(
        True, doc="prefill on the decode worker when prefill is busier (see configs/README.md)"
    )
    elastic_busy_max_tokens: int = opt(
        64, lo=0, doc="elastic: the longest prompt a decode worker with requests in flight takes"
    )
    elastic_tokens_per_output: float = opt(
        6.0,
        lo=0.0,
        hi=MAX_PER_OUTPUT,
        doc="elastic: ... or what its requests absorb: this x each max_tokens (0: off)",
    )
    tpot_slo_ms: float = opt(
        0.0,
        lo=0.0,
        hi=3.6e6,
        doc="elastic: a TPOT target whose headroom decode workers spend on prompts",
    )
    kv_overlap_weight: float = opt(1.0, lo=0.0, doc="kv_aware: weight of prompt blocks to compute")
    prefix_pull_min_tokens: int = opt(
        32, lo=0, doc="kv_aware: pull a prefix held elsewhere when it saves this many tokens"
    )
    decode_prefix_reuse: bool = opt(
        True, doc="decode serves the prompt's prefix from its cache; only the suffix's KV moves"
    )
    heartbeat_timeout_s: float = opt(5.0, lo=0.1)
    #: A streaming client that takes no data for this long is cut off and its request ended.
    write_timeout_s: float = opt(30.0, lo=0.1)
    rebalance: RebalanceSpec = field(default_factory=RebalanceSpec)

    def router_config(self, block_size: int) -> RouterConfig:
        """The Router's settings; `block_size` is the engines' (prompt hashes must agree)."""
        return RouterConfig(
            routing=RoutingConfig(
                policy=self.policy,  # type: ignore[arg-type]
                local_prefill_max_tokens=self.local_prefill_max_tokens,
                elastic_prefill=self.elastic_prefill,
                elastic_busy_max_tokens=self.elastic_busy_max_tokens,
                elastic_tokens_per_output=self.elastic_tokens_per_output,
                tpot_slo_ms=self.tpot_slo_ms,
                block_size=block_size,
                kv_overlap_weight=self.kv_overlap_weight,
                prefix_pull_min_tokens=self.prefix_pull_min_tokens,
                decode_prefix_reuse=self.decode_prefix_reuse,
            ),
            failure_policy=self.failure_policy,  # type: ignore[arg-type]
            max_inflight=self.max_inflight,
            max_inflight_per_key=self.share_per_key(),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            rebalance=self.rebalance.config(),
        )

    def share_per_key(self) -> int:
        """Each API key's share of the completions in flight: as set, else an equal part of
        the whole (all of it for one key, or without keys, when every client is one)."""
        if not self.api_keys:
            return self.max_inflight
        return self.max_inflight_per_key or max(1, self.max_inflight // len(self.api_keys))


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """The `transfer:` section: a worker's transfer engine config under the same names
    (`timeout_s` too: one name end to end), plus what the worker
    itself does with KV (`layerwise`, `remote_kv_timeout_s`) and the deployment secret."""

    #: Push each layer's KV as soon as it is computed (the worker's, not the transfer's).
    layerwise: bool = False
    #: Checksums on every transport (shm and direct writes too).
    checksum: bool = True
    transports: tuple[str, ...] = opt(TRANSPORTS, choices=TRANSPORTS)
    #: Deadline of a whole transfer, all retries included.
    timeout_s: float = opt(30.0, lo=0.1)
    secret: str = ""
    #: Longest a shared-memory write into a decode worker's blocks may take; blocks released
    #: while one is open are not reused before it ends.
    grant_s: float = opt(10.0, lo=0.1)
    #: How long a decode worker waits for a prompt's KV before computing it itself.
    remote_kv_timeout_s: float = opt(60.0, lo=0.1)
    #: KV on the TCP wire: "none" (raw) or "int8" (a scale per token and head; lossy, 0.27x
    #: float32's bytes). Shared-memory writes on one host always move raw KV.
    kv_codec: str = opt("none", choices=KV_CODECS)
    #: KV chunks on the TCP wire sealed with AES-256-GCM: "auto" between hosts, "on"
    #: always, "off" never (transfer/aead.py).
    encrypt: str = opt("auto", choices=("auto", "on", "off"))
    #: For tests and fault drills only: worker id (e.g. "prefill-0") -> FaultRule fields
    #: (kind, msg_type, nth, count, delay_s) injected into that worker's outgoing transfer
    #: frames, or with msg_type "step" delaying its engine steps (a slower device; see
    #: transfer/faults.py). Never set this in production.
    faults: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    def transfer_config(
        self, worker_id: str, host: str, port: int, data_port: int = 0
    ) -> TransferConfig:
        """Worker `worker_id`'s transfer engine config, listening on `host`:`port` (its data
        channel on `data_port`, 0: any); it links only under the pair keys the router sends
        the worker (`hetero_pd.serving.worker.config.transfer_config`), never a key from here."""
        return TransferConfig(
            host=host,
            port=port,
            data_port=data_port,
            timeout_s=self.timeout_s,
            grant_s=self.grant_s,
            transports=self.transports,
            checksum=self.checksum,
            kv_codec=self.kv_codec,
            encrypt=self.encrypt,
            faults=self.fault_plan(worker_id).split()[0],
        )

    def step_faults(self, worker_id: str) -> FaultPlan | None:
        """The rules of `faults` on worker `worker_id`'s engine steps, if any."""
        return self.fault_plan(worker_id).split()[1]

    def fault_plan(self, worker_id: str) -> FaultPlan:
        """All of `faults`' rules on worker `worker_id` (none: an empty plan)."""
        return FaultPlan(tuple(FaultRule(**rule) for rule in self.faults.get(worker_id, ())))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The traffic a deployment is sized for (DistServe-style SLOs)."""

    input_len: int = opt(512, lo=1, doc="mean prompt tokens")
    output_len: int = opt(128, lo=1, doc="mean generated tokens")
    rate: float = opt(1.0, lo=0.0, doc="requests per second")
    ttft_ms: float = opt(2000.0, lo=1.0, doc="time-to-first-token target")
    tpot_ms: float = opt(100.0, lo=0.1, doc="time-per-output-token target")


@dataclass(frozen=True, slots=True)
class Capacity:
    """Measured throughput of one worker on a device kind (`hetero-pd plan --measure`)."""

    prefill_tokens_per_s: float = opt(1000.0, lo=0.001)
    decode_step_ms: float = opt(20.0, lo=0.001, doc="one decode step at batch 1")
    decode_ms_per_seq: float = opt(1.0, lo=0.0, doc="added per sequence in the batch")


@dataclass(frozen=True, slots=True)
class PDSpec:
    """Workers from a P:D ratio instead of a list. 0/0 means automatic (`hetero_pd.deploy.
    ratio`): counts sized from measured throughput and the `workload` section."""

    default_p_rate: int = opt(0, lo=0)
    default_d_rate: int = opt(0, lo=0)
    instances: int = opt(0, lo=0, doc="total workers split by the rates; 0 when automatic")
    max_instances: int = opt(0, lo=0, doc="automatic: cap on the total (0: no cap)")
    prefill_device: str = "cpu"
    decode_device: str = "cpu"
    #: Per-role dtype and KV layout ("" / "auto": as for `workers[].dtype` / `.kv_layout`).
    prefill_dtype: str = opt("", choices=WORKER_DTYPES)
    decode_dtype: str = opt("", choices=WORKER_DTYPES)
    prefill_kv_layout: str = opt("auto", choices=WORKER_KV_LAYOUTS)
    decode_kv_layout: str = opt("auto", choices=WORKER_KV_LAYOUTS)
    prefill_tensor_parallel_size: int = opt(
        1, lo=1, hi=64, doc="devices (ranks) each prefill worker takes"
    )
    decode_tensor_parallel_size: int = opt(
        1, lo=1, hi=64, doc="devices (ranks) each decode worker takes"
    )
    #: device kind -> Capacity fields
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    """The edge split: the device runs layers [0, split_layer), the cloud the rest."""

    enabled: bool = True
    split_layer: int = opt(4, lo=1, doc="devices run layers [0, k); workers run [k, L)")
    codec: str = opt("float16", choices=EDGE_CODECS)
    runtime: str = opt("torch", choices=("torch", "onnx"))
    max_recovery: float | None = opt(
        None,
        lo=0.0,
        hi=1.0,
        doc="refuse a split_layer whose measured token recovery (bench edge-privacy) is above",
    )
    tls: bool = opt(
        True, doc="serve edge sessions over TLS on their own port (off: on the API's, in clear)"
    )
    port: int = opt(8443, lo=0, hi=65535, doc="the edge sessions' TLS port (0: any free one)")
    tls_cert: str = opt("", doc="PEM certificate devices trust; empty: generate a self-signed")
    tls_key: str = opt("", doc="its private key (PEM)")


@dataclass(frozen=True, slots=True)
class SupervisorSpec:
    """What the local supervisor does when a worker process dies, and role switching."""

    restart: bool = True
    max_restarts: int = opt(5, lo=0, doc="per worker within window_s; then it stays down")
    window_s: float = opt(300.0, lo=1.0)
    backoff_s: float = opt(0.5, lo=0.0, doc="first restart delay, doubled each time")
    backoff_max_s: float = opt(30.0, lo=0.0)
    ready_timeout_s: float = opt(300.0, lo=1.0)
    stop_grace_s: float = opt(10.0, lo=0.0)
    fork_server: bool | None = opt(
        None,
        doc="fork workers from one process that imported torch once (deploy/forkserver.py); "
        "unset: $HETERO_PD_FORK_SERVER, off when that is unset too",
    )
    hang_timeout_s: float = opt(
        20.0, lo=0.5, doc="a live process silent this long (stopped, deadlocked) is restarted"
    )
    role_switch: bool = opt(False, doc="move workers between prefill and decode on load")
    switch_interval_s: float = opt(10.0, lo=0.1)
    switch_imbalance: float = opt(4.0, lo=1.0, doc="queue ratio that triggers a switch")


@dataclass(frozen=True, slots=True)
class KubernetesSpec:
    """How `hetero-pd render k8s` lays the deployment out on a cluster."""

    name: str = "hetero-pd"
    namespace: str = "default"
    image: str = "hetero-pd:0.1.0"
    image_pull_policy: str = opt("IfNotPresent", choices=("IfNotPresent", "Always", "Never"))
    base_port: int = opt(9000, lo=1024, hi=65000, doc="worker control port; +1 transfer, +2 data")
    service_type: str = opt("ClusterIP", choices=("ClusterIP", "NodePort", "LoadBalancer"))
    model_pvc: str = opt("", doc="PersistentVolumeClaim holding the model cache")
    worker_cpu: str = "2"
    worker_memory: str = "8Gi"
    router_cpu: str = "1"
    router_memory: str = "2Gi"
    device_resources: dict[str, str] = field(default_factory=lambda: dict(DEVICE_RESOURCES))
    node_selectors: dict[str, dict[str, str]] = field(default_factory=lambda: dict(NODE_SELECTORS))
    #: An image per kind (`router`, `cpu`, `cuda`, `npu`: docker/Dockerfile.*); `image` for
    #: any kind not named here.
    images: dict[str, str] = field(default_factory=dict)
    #: runtimeClassName per device kind (e.g. `cuda: nvidia`, `npu: ascend`).
    runtime_classes: dict[str, str] = field(default_factory=dict)
    #: Read-only hostPath mounts per device kind; Ascend's driver paths by default.
    host_mounts: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {"npu": ASCEND_HOST_MOUNTS}
    )
    #: Size of each pod's memory-backed /dev/shm.
    shm_size: str = "1Gi"
    #: A Secret the operator manages (keys `secret` and `api-keys`); "" = render one.
    existing_secret: str = ""
    #: Let only the router and peer workers reach worker ports (a NetworkPolicy).
    network_policy: bool = True
