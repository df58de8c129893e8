"""Points where a caller may act on a run: tests inject faults through them (no settings by
environment variable). The defaults do nothing; a subclass overrides what it needs and is passed
to `Trainer(cfg, hooks=...)` (tests/fault_injection.py launches training that way)."""

from __future__ import annotations


class TrainHooks:
    def after_backward(self, step: int, loss: float, model_chunks) -> float:
        """Step `step` (1-based, as logged) ran forward and backward; the optimizer has not stepped.
        Returns the loss the non-finite guard sees."""
        return loss

    def before_commit(self, step: int) -> None:
        """The checkpoint of `step` is written on every rank and not yet committed."""
