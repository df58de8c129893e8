"""`moe_sft.train` with faults injected through the trainer's hooks (moe_sft/trainer/hooks.py).

    torchrun ... tests/fault_injection.py "nan_grad=2;nan_loss=3,4;kill_in_save=4" --config-path ...

The first argument names faults and the 1-based steps (as logged) they fire at; the rest is
`moe_sft.train`'s command line:
- nan_loss: the step's loss reads NaN (the non-finite guard skips the update);
- nan_grad: one parameter's main gradient is NaN (the gradient norm is non-finite);
- kill_in_save: the process dies like `kill -9` once the checkpoint of that step is written on every
  rank and before it is committed.
- kill_in_write: the trainer alone is killed with SIGKILL (the OOM killer) while megatron's forked
  writer writes that step's checkpoint; the writer then goes on for 30 s, as one writing a large
  checkpoint would (its pid is written to `<output_dir>/writer.pid`).
"""

from __future__ import annotations

import os
import sys

from moe_sft.trainer.hooks import TrainHooks


def parse_faults(spec: str) -> dict[str, set[int]]:
    faults = {}
    for part in filter(None, spec.split(";")):
        name, steps = part.split("=")
        faults[name] = {int(s) for s in steps.split(",")}
    unknown = set(faults) - {"nan_loss", "nan_grad", "kill_in_save", "kill_in_write"}
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}")
    return faults


class FaultHooks(TrainHooks):
    def __init__(self, faults: dict[str, set[int]]):
        self.faults = faults
        if "kill_in_write" in faults:
            _kill_trainer_from_writer(faults["kill_in_write"])

    def after_backward(self, step, loss, model_chunks):
        if step in self.faults.get("nan_grad", ()):
            param = next(p for c in model_chunks for p in c.parameters() if p.requires_grad)
            param.main_grad.fill_(float("nan"))
        return float("nan") if step in self.faults.get("nan_loss", ()) else loss

    def before_commit(self, step):
        if step in self.faults.get("kill_in_save", ()):
            die_like_sigkill()


def _kill_trainer_from_writer(steps: set[int]) -> None:
    """Arms megatron's writer (forked from the trainer) to SIGKILL the trainer in the saves of `steps`."""
    import signal
    import time

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from moe_sft.trainer import checkpoint

    armed: dict = {}
    save, write = checkpoint.Saver.save, FileSystemWriterAsync.write_preloaded_data

    def saving(self, step, *args, **kwargs):
        armed["dir"] = self.root.parent if step in steps else None
        return save(self, step, *args, **kwargs)

    def writing(*args, **kwargs):
        if armed.get("dir") is not None:  # in the writer: the trainer is its parent
            (armed["dir"] / "writer.pid").write_text(str(os.getpid()))
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(30)  # a writer still busy with a large checkpoint
        return write(*args, **kwargs)

    checkpoint.Saver.save = saving
    FileSystemWriterAsync.write_preloaded_data = staticmethod(writing)


def die_like_sigkill() -> None:
    """What `kill -9` of the job does: this process and its helpers (dist_checkpointing's
    multiprocessing manager would otherwise outlive it holding the launcher's pipes) stop now."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(137)


if __name__ == "__main__":  # dist_checkpointing spawns a process: the guard is required
    from moe_sft.train import main

    sys.exit(main(sys.argv[2:], hooks=FaultHooks(parse_faults(sys.argv[1]))))
