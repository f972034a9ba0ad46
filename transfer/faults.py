"""Fault injection on an engine's outgoing frames, for tests.

A :class:`FaultPlan` is a list of rules; each rule fires on the ``nth`` .. ``nth+count-1``
outgoing frames of one message type (``"data"``, ``"begin"``, ``"end"``, ``"ack"``, ...,
or ``"*"`` for any). Direct writes (local, shm) have no frames: rules for ``"direct"`` fire
on their chunk copies instead (drop: not copied, corrupt: a byte flipped in the destination
after the copy, delay: the copy pauses first, duplicate: copied twice, reorder: copied last,
disconnect: the session drops). Rules for ``"step"`` fire on the engine steps of the worker
that holds the plan, never on a frame (``"*"`` does not match them): only ``delay``, the
step starts ``delay_s`` after the previous one started at the earliest (each takes that long
at least: a slower device), while the worker serves its control socket and transfers, at no
CPU cost (hetero_pd/serving/worker/step_faults.py). Deterministic by
construction: no randomness, no clocks.

==========  =================================================================
drop        the frame is not sent
delay       the frame is sent ``delay_s`` later (other frames overtake it)
duplicate   the frame is sent twice
reorder     the frame is held back and sent after the next frame
corrupt     one payload byte is flipped (a header byte when there is no payload)
disconnect  the link's socket is closed abruptly before this frame
==========  =================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("drop", "delay", "duplicate", "reorder", "corrupt", "disconnect")
#: The ``msg_type`` of a worker's engine steps (see the module docstring).
STEP = "step"


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault: ``kind`` applied to matching frames number ``nth`` (1-based) onwards."""

    kind: str
    msg_type: str = "data"
    nth: int = 1
    count: int = 1
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"FaultRule.kind must be one of {KINDS}, got {self.kind!r}")
        if self.nth < 1 or self.count < 1:
            raise ValueError("FaultRule: nth and count must be >= 1")
        if self.delay_s < 0:
            raise ValueError(f"FaultRule.delay_s must be >= 0 seconds, got {self.delay_s}")
        if self.msg_type == STEP and self.kind != "delay":
            raise ValueError(f"FaultRule: a step can only be delayed, not {self.kind!r}")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Rules applied in order; the first rule that fires on a frame decides its fate."""

    rules: tuple[FaultRule, ...] = ()

    def split(self) -> tuple[FaultPlan | None, FaultPlan | None]:
        """(the rules on frames, the rules on engine steps), each None when it has none."""
        frames = tuple(r for r in self.rules if r.msg_type != STEP)
        steps = tuple(r for r in self.rules if r.msg_type == STEP)
        return (FaultPlan(frames) if frames else None, FaultPlan(steps) if steps else None)


@dataclass(slots=True)
class Outgoing:
    """What the engine should do with one frame after injection."""

    parts: list[bytes | memoryview]
    #: Where the frame goes (the engine's session object; opaque here).
    target: Any = None
    delay_s: float = 0.0
    disconnect_first: bool = False


@dataclass(slots=True)
class FaultInjector:
    """Runtime state of a plan: per-rule match counters and the frame held for reordering."""

    plan: FaultPlan
    seen: list[int] = field(default_factory=list)
    held: list[Outgoing] = field(default_factory=list)
    fired: int = 0

    def __post_init__(self) -> None:
        self.seen = [0] * len(self.plan.rules)

    def match(self, msg_type: str) -> FaultRule | None:
        """Count one event of ``msg_type``; the rule that fires on it, if any."""
        fired: FaultRule | None = None
        for i, rule in enumerate(self.plan.rules):
            if rule.msg_type not in ("*", msg_type):
                continue
            self.seen[i] += 1
            if fired is None and rule.nth <= self.seen[i] < rule.nth + rule.count:
                fired = rule
        if fired is not None:
            self.fired += 1
        return fired

    def apply(self, msg_type: str, parts: list[bytes | memoryview], target: Any) -> list[Outgoing]:
        """Return the frames to send (possibly none, delayed, doubled or altered)."""
        out: list[Outgoing] = []
        fired = self.match(msg_type)
        frame = Outgoing(parts, target)
        if fired is None:
            out.append(frame)
        else:
            if fired.kind == "delay":
                frame.delay_s = fired.delay_s
                out.append(frame)
            elif fired.kind == "duplicate":
                out += [frame, Outgoing(list(parts), target)]
            elif fired.kind == "reorder":
                self.held.append(frame)
                return out
            elif fired.kind == "corrupt":
                out.append(Outgoing(_corrupt(parts), target))
            elif fired.kind == "disconnect":
                frame.disconnect_first = True
                out.append(frame)
            # "drop": nothing is sent
        out += self.held
        self.held = []
        return out

    def flush(self) -> list[Outgoing]:
        """Frames still held back (sent when no later frame came)."""
        out, self.held = self.held, []
        return out


def _corrupt(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    victim = min(1, len(parts) - 1)  # the payload (after it, at most a digest trailer)
    data = bytearray(parts[victim])
    if data:
        data[len(data) // 2] ^= 0x5A
    return [*parts[:victim], bytes(data), *parts[victim + 1 :]]
