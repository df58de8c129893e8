"""Python's garbage collector on a schedule during GPU training, as Megatron-LM's `--manual-gc`.

A full collection walks every object megatron and torch keep alive, on whichever rank and at
whichever step the allocation counters say. On many ranks one rank's pause stalls all of them at
the next collective, which is why Megatron-LM can freeze setup's objects out of collection
(`gc.freeze`), turn automatic collection off and collect every N steps, the same step on every
rank. `trainer.gc_interval` (0, the default, keeps Python's collector) does that here, on CUDA
only. On one GPU it made no difference we could measure (docs/log.md), so it stays opt-in until
a multi-node run shows a gain.
"""

from __future__ import annotations

import gc


class ScheduledGC:
    def __init__(self, interval: int, device: str):
        self.active = interval > 0 and device == "cuda"
        self.interval = interval
        if self.active:
            gc.collect()
            gc.freeze()  # setup's objects: never scanned again
            gc.disable()

    def before_step(self, step: int) -> None:
        if self.active and step % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.active:
            gc.enable()
            gc.unfreeze()
            self.active = False
