"""Steps with a non-finite loss or gradient norm are skipped, counted, and end the run when they
repeat; a gradient norm of exactly 0 several steps in a row (a collapsed model) is warned about;
SIGTERM / SIGUSR1 (slurm pre-emption, `sbatch --signal`), SIGINT (Ctrl-C) or a STOP file in the
output directory end it after a checkpoint, and the helper processes the trainer starts leave those signals to it.

Skipping happens inside megatron's own `optimizer.step()`: its gradient norm is an all-reduce, so
every rank sees the same value and skips together, after gradients are prepared and before any
parameter changes. The LR schedule does not advance on a skipped step (as in Megatron-LM); the
data position does (the batch is consumed, not retried).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


class _NonFiniteGradNorm(Exception):
    def __init__(self, norm: float):
        self.norm = norm


def step_unless_non_finite(optimizer, loss: float) -> tuple[bool, float]:
    """(stepped, grad norm). A non-finite loss skips without touching the optimizer at all."""
    if not math.isfinite(loss):
        return False, float("nan")
    compute_norm = optimizer.get_grad_norm

    def checked_norm():
        norm = compute_norm()
        if norm is not None and not math.isfinite(norm):
            raise _NonFiniteGradNorm(norm)
        return norm

    optimizer.get_grad_norm = checked_norm  # the instance attribute shadows the method
    try:
        ok, grad_norm, _ = optimizer.step()
    except _NonFiniteGradNorm as err:
        return False, err.norm
    finally:
        del optimizer.get_grad_norm
    return bool(ok), float(grad_norm if grad_norm is not None else float("nan"))


class SkipCounter:
    """Counts skipped steps; raises once `max_in_a_row` consecutive steps were skipped."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row: list[int] = []

    def record(self, step: int, stepped: bool, loss: float, grad_norm: float) -> None:
        if stepped:
            self.in_a_row = []
            return
        self.total += 1
        self.in_a_row.append(step)
        if len(self.in_a_row) >= self.max_in_a_row:
            raise NonFiniteTrainingError(
                f"steps {self.in_a_row[0]}..{self.in_a_row[-1]}: {len(self.in_a_row)} steps in a row "
                f"had a non-finite loss or gradient norm (last: loss={loss}, grad_norm={grad_norm}); "
                "the run stops rather than train on garbage. Lower optimizer.lr, check the data of "
                "these steps, or raise trainer.max_skipped_steps_in_a_row"
            )


class NonFiniteTrainingError(RuntimeError):
    pass


class ZeroGradStreak:
    """Gradient norm exactly 0 step after step: nothing trains any more (e.g. a model collapsed by
    a far too high LR: the loss is flat, the run would exit 0 having learned nothing). `record`
    returns a warning once per streak, at its `warn_after`-th step; `summary()` lists the streaks."""

    def __init__(self, warn_after: int = 5):
        self.warn_after = warn_after
        self.current: list[int] = []
        self.streaks: list[list[int]] = []  # [first, last] of each streak that was warned about

    def record(self, step: int, grad_norm: float, loss: float, lr: float) -> str | None:
        if grad_norm != 0.0:  # a skipped (NaN) step ends a streak too
            self.current = []
            return None
        self.current.append(step)
        if len(self.current) < self.warn_after:
            return None
        if len(self.current) > self.warn_after:
            self.streaks[-1][1] = step
            return None
        self.streaks.append([self.current[0], step])
        return (
            f"warning: gradient norm exactly 0 for {len(self.current)} steps in a row (steps "
            f"{self.current[0]}..{step}; loss {loss:.4g}, lr {lr:.3g}): nothing is training. The model "
            "has probably collapsed (too high optimizer.lr?) or every parameter is frozen; the run "
            "goes on"
        )

    def summary(self) -> str | None:
        if not self.streaks:
            return None
        return "gradient norm exactly 0 in steps " + ", ".join(
            f"{first}..{last} ({last - first + 1} steps)" for first, last in self.streaks
        )


class StopRequest:
    """A stop asked for by SIGTERM/SIGUSR1/SIGINT on any rank, or by a file `stop_file` (what a
    batch script can create from its own signal trap without knowing the worker PIDs: torchrun
    itself dies of SIGUSR1). `agreed()` makes every rank stop after the same step.

    Ctrl-C (SIGINT, which torchrun forwards to the workers) saves a stop checkpoint like SIGTERM;
    a third SIGINT gives up on it and raises KeyboardInterrupt (a run hung in a collective)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    SIGINTS_TO_ABORT = 3

    def __init__(self, stop_file: Path):
        self.received: str | None = None
        self.sigints = 0
        self.stop_file = Path(stop_file)
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.sigints += 1
            if self.sigints >= self.SIGINTS_TO_ABORT:
                raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

    def agreed(self, device: str) -> bool:
        if self.received is None and dist.get_rank() == 0 and self.stop_file.exists():
            self.received = f"file {self.stop_file}"
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def consume(self) -> None:
        """The next launch must not stop at once."""
        if dist.get_rank() == 0:
            self.stop_file.unlink(missing_ok=True)


HELPER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def shield_helper_process(parent_pid: int) -> None:
    """Initializer of a helper process the trainer spawns (megatron's checkpoint-results manager).

    torchrun forwards SIGTERM to each worker's whole process group and slurm's scancel signals every
    process of the job: a helper that died of it would fail the very checkpoint that the signal asks
    for (ConnectionRefusedError in megatron's writer, only `step_N.tmp` left). The stop signals are
    the trainer's to act on; the helper ignores them and exits by itself once the trainer is gone.
    """
    for sig in HELPER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_IGNORED_SIGNALS)  # blocked by the spawner

    def exit_with_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=exit_with_parent, name="moe-sft-parent-watch", daemon=True).start()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_forked_from: dict = {}


def _note_forking_thread() -> None:
    _forked_from.update(pid=os.getpid(), main=threading.current_thread() is threading.main_thread())


def _die_with_parent() -> None:
    """In a forked child: SIGKILL when the parent dies. Linux sends it when the forking *thread*
    ends, so only children forked by the main thread (it lives as long as the process) get it."""
    if not _forked_from.get("main"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != _forked_from["pid"]:  # the parent died before prctl
        os._exit(1)


def forked_helpers_die_with_this_process() -> None:
    """Every child this process forks from now on (megatron's checkpoint writers: one forked per
    save, and per bucket inside it) is killed when this process dies: killed with SIGKILL (the OOM
    killer) mid-save, the trainer would otherwise leave them writing, then blocked on a queue whose
    reader is gone, for ever. Linux only (prctl PR_SET_PDEATHSIG); elsewhere nothing is set. Spawned
    helpers (the results manager) watch their parent themselves (`shield_helper_process`)."""
    if sys.platform != "linux" or _forked_from.get("installed"):
        return
    _forked_from["installed"] = True
    os.register_at_fork(before=_note_forking_thread, after_in_child=_die_with_parent)
