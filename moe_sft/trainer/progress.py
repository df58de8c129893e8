"""Rank-0 progress line with an ETA:
`step 120/2000 (6.0%) elapsed 00:12:03 ETA 03:08:10 at 4.2 s/step`.

The step time is the wall-clock time between the ends of consecutive steps, so checkpoint saves,
evaluation and logging count towards the ETA. The ETA is the remaining steps times the mean of
the last `window` step times; the first step of a run (compilation, allocator and communicator
warm-up) is left out of the mean.
"""

from __future__ import annotations

import time
from collections import deque


def hms(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, window: int = 20, clock=time.perf_counter):
        self.clock = clock
        self.start = self.last = clock()
        self.durations: deque[float] = deque(maxlen=window)
        self.ticks = 0

    def tick(self) -> None:
        """Call once at the end of every step."""
        now = self.clock()
        if self.ticks:  # the first step (warm-up) stays out of the average
            self.durations.append(now - self.last)
        self.ticks += 1
        self.last = now

    def seconds_per_step(self) -> float | None:
        return sum(self.durations) / len(self.durations) if self.durations else None

    def line(self, step: int, max_steps: int) -> str:
        head = (
            f"step {step}/{max_steps} ({100.0 * step / max(max_steps, 1):.1f}%) elapsed {hms(self.last - self.start)}"
        )
        per = self.seconds_per_step()
        if per is None:
            return f"{head} ETA --:--:-- (after the warm-up step)"
        return f"{head} ETA {hms(per * max(max_steps - step, 0))} at {per:.3g} s/step"
