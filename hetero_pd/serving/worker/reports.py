"""What a worker tells the router about itself in each heartbeat: its engine's load, its
transfer engine's counters and health, and its speculative decoding totals, as the typed
values of `hetero_pd/serving/control/values.py`."""

from __future__ import annotations

from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import values as V
from hetero_pd.serving.worker.requests import RequestBook
from transfer import TransferEngine


def load_report(
    engine: LLMEngine,
    transfer: TransferEngine,
    book: RequestBook,
    frames_rejected: int,
    draining: bool,
) -> V.WorkerLoad:
    """The heartbeat's load report (kv_usage clamped to [0, 1])."""
    load = engine.load()
    metrics = transfer.metrics()
    return V.WorkerLoad(
        waiting=load.waiting,
        running=load.running,
        remote=load.remote,
        held=load.held,
        waiting_tokens=load.waiting_tokens,
        kv_usage=min(max(load.kv_usage, 0.0), 1.0),
        free_blocks=load.free_blocks,
        draining=draining,
        kv_fallbacks=book.kv_fallbacks,
        frames_rejected=frames_rejected,
        transfer_healthy=transfer.healthy(),
        transfer_auth_failures=metrics.auth_failures_total,
        transfer_faults_injected=metrics.faults_injected_total,
        transfer={
            name: V.TransportCounters.of(counters) for name, counters in metrics.transports.items()
        },
        prompt_tokens_computed=load.prompt_tokens_computed,
        decode_step_s=min(load.decode_step_s, V.MAX_SECONDS),
        prompt_token_s=min(load.prompt_token_s, V.MAX_SECONDS),
        prefix_pulls=book.pulls.done,
        prefix_pulled_tokens=book.pulls.tokens,
        prefix_pull_failures=book.pulls.failed,
        spec_decode=spec_decode_counts(engine),
    )


def spec_decode_counts(engine: LLMEngine) -> V.SpecDecodeCounts | None:
    """The engine's speculative decoding totals (None: it does not speculate)."""
    if engine.speculator is None:
        return None
    s = engine.speculator.stats
    return V.SpecDecodeCounts(
        drafts=s.num_drafts,
        draft_tokens=s.num_draft_tokens,
        accepted_tokens=s.num_accepted_tokens,
        accepted_per_pos=list(s.accepted_per_pos),
    )
