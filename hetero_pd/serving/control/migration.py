"""The messages of a live migration: a decoding request moves from worker A to worker B
with its KV and its state, and its stream goes on from B without a gap or a repeat.

    router              B (destination)                   A (source)
      |-- MigrateIn ------>| reserves blocks for the request's tokens, a grant for A
      |<-- MigrateReady ---| (its blocks and epoch)
      |-- MigrateOut --------------------------------------->| pre-copy: pushes the full
      |                    |<====== full blocks (checksums) ==| blocks while it decodes on
      |                    |                                  | (rounds until few are new)
      |                    |<====== the rest, last partial ===| paused for this push only
      |<-- MigrateState (generated tokens, generator, logprobs, seq) --| keeps it paused
      |    (one state per completion still running: an n > 1 request moves whole)
      |-- MigrateResume -->| checks the state, rebuilds what derives from the tokens
      |<-- Migrated -------| (grammar, detokenizer, stop matcher, penalties), decodes on;
      |<-- Output seq k ...| its outputs follow Migrated on the same socket
      |-- Abort ---------------------------------------------->| frees the paused request

Any failure before Migrated (B refuses, dies, a push fails, the request is preempted or
finishes): MigrateFailed or the router's own deadline; the router sends MigrateCancel to A,
which decodes on as if nothing happened, and Abort to B, which releases its reservation.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, field

from hetero_pd.sampling_params import MAX_N
from hetero_pd.serving.control.sampling import Positions, TokenIds, WireParams
from hetero_pd.serving.control.values import Count, Envelope, Message, Name, PromptCount, Rid, Value
from transfer import RemoteBlocks

Index = Annotated[int, Meta(ge=0, lt=MAX_N)]  # one of a request's n completions
#: A seeded request's generator state (torch's CPU generator state is 5056 bytes).
MAX_GENERATOR_BYTES = 1 << 16


class RequestState(Value, kw_only=True, frozen=True):
    """What a decoding request is besides its prompt and its KV. Its penalties' counts,
    its grammar's place and its stop-string matcher all follow from `output_ids` (the
    destination replays them); the rest travels here."""

    index: Index = 0  # which of the request's n completions
    output_ids: TokenIds  # every generated token; the last one's KV is not computed yet
    generator: Annotated[bytes, Meta(max_length=MAX_GENERATOR_BYTES)] | None = None
    logprobs: Positions | None = None  # one position per output token, when asked
    cumulative_logprob: float = 0.0
    #: Characters of the completion's text already streamed (the destination's replay of
    #: the detokenizer and stop matcher must agree).
    sent_chars: Count
    seq: Count  # the request's next Output sequence number
    cached_tokens: PromptCount = 0


#: The completions of a request that move (each one's index), in the order of their
#: blocks in the destination's reservation.
Choices = Annotated[list[Index], Meta(min_length=1, max_length=MAX_N)]
States = Annotated[list[RequestState], Meta(min_length=1, max_length=MAX_N)]


class MigrateIn(Envelope, tag="migrate_in", kw_only=True, frozen=True):
    """Router -> destination: reserve room for `num_tokens` of the request's KV for each
    completion in `choices` (an n > 1 request's that still run), writable by `writer`
    only; one reservation, the completions' blocks one after the other."""

    rid: Rid
    prompt_ids: TokenIds
    params: WireParams
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    writer: Annotated[str, Meta(min_length=1, max_length=256)]
    num_tokens: PromptCount
    choices: Choices = field(default_factory=lambda: [0])


class MigrateReady(Envelope, tag="migrate_ready", kw_only=True, frozen=True):
    rid: Rid
    blocks: RemoteBlocks


class MigrateOut(Envelope, tag="migrate_out", kw_only=True, frozen=True):
    """Router -> source: copy the request's KV into `dest_blocks` (block i of completion
    `choices[c]` into block i of its c-th equal share), then pause it and send its state."""

    rid: Rid
    dest_worker_id: Name
    dest_address: Name
    dest_blocks: RemoteBlocks
    #: False: no pre-copy, every block moves while the request is paused (stop-and-copy,
    #: what `hetero-pd bench migrate` compares against).
    precopy: bool = True
    choices: Choices = field(default_factory=lambda: [0])


class MigrateState(Envelope, tag="migrate_state", kw_only=True, frozen=True):
    """Source -> router: the KV is on the destination; the request is paused here."""

    rid: Rid
    states: States  # one per completion still running, the others finished there
    bytes: Count  # KV bytes pushed, every round
    rounds: Count  # pushes, the last one while paused
    paused_s: Annotated[float, Meta(ge=0.0)]  # paused so far (the last push)


class MigrateResume(Envelope, tag="migrate_resume", kw_only=True, frozen=True):
    rid: Rid
    states: States


class Migrated(Envelope, tag="migrated", kw_only=True, frozen=True):
    """Destination -> router: it decodes the request now; its outputs follow."""

    rid: Rid


class MigrateCancel(Envelope, tag="migrate_cancel", kw_only=True, frozen=True):
    """Router -> source: the migration is off; decode the request on here."""

    rid: Rid


class MigrateFailed(Envelope, tag="migrate_failed", kw_only=True, frozen=True):
    """Source or destination -> router: the migration cannot go on. `not_here`: the source
    does not decode the request now (it finished, its KV is still arriving, or it finished
    or was preempted while its KV was being copied), so nothing needs moving yet: the
    router looks again rather than counting a failed migration."""

    rid: Rid
    message: Message
    not_here: bool = False


FromWorker = MigrateReady | MigrateState | Migrated | MigrateFailed
