"""What an engine's steps cost, as its heartbeat reports it: the seconds of a decode-only
step and of a prompt token computed in a step, each a moving average of the latest steps.

The router weighs them against a TPOT target to decide how many prompt tokens a decode
worker may compute beside the requests it decodes (serving/router/policy.py). Both are
wall time on whatever threads the step had, so they follow the CPU share as it changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hetero_pd.engine.scheduler import SchedulerOutput

#: Weight of the newest step in each average.
ALPHA = 0.25
#: A step computing fewer prompt tokens than this says little about a prompt token's cost
#: (its decode rows and fixed costs weigh as much): it updates neither average.
MIN_PROMPT_TOKENS = 64


@dataclass(slots=True)
class Step:
    prompt_tokens: int
    started: float


class StepCosts:
    """The moving averages, and the prompt tokens computed since the engine started."""

    def __init__(self) -> None:
        self.prompt_tokens_computed = 0
        #: Seconds of a step that computes no prompt token (0.0: none seen yet).
        self.decode_step_s = 0.0
        #: Seconds per prompt token of a step that computes some, its decode rows' share
        #: counted in (so a little above the prompt's own cost; 0.0: none seen yet).
        self.prompt_token_s = 0.0

    def start(self, out: SchedulerOutput) -> Step:
        """Called as a step begins; the step's prompt tokens count as computed from now."""
        prompt = sum(
            max(0, min(c.num_tokens, c.request.num_prompt_tokens - c.request.num_computed_tokens))
            for c in out.chunks
        )
        self.prompt_tokens_computed += prompt
        return Step(prompt, time.perf_counter())

    def done(self, step: Step) -> None:
        """Called when the step ran whole (a failed step's time says nothing of a step)."""
        seconds = time.perf_counter() - step.started
        if step.prompt_tokens == 0:
            self.decode_step_s = _mix(self.decode_step_s, seconds)
        elif step.prompt_tokens >= MIN_PROMPT_TOKENS:
            self.prompt_token_s = _mix(self.prompt_token_s, seconds / step.prompt_tokens)


def _mix(average: float, sample: float) -> float:
    return sample if average == 0.0 else average + ALPHA * (sample - average)
