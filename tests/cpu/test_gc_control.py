"""ScheduledGC: on CUDA the collector is frozen out of setup's objects, off between scheduled
collections, and restored on close; on CPU nothing changes."""

import gc

from moe_sft.trainer.gc_control import ScheduledGC


def test_cuda_runs_collect_on_schedule_and_restore_the_collector(monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    before = gc.get_freeze_count()
    sched = ScheduledGC(interval=3, device="cuda")
    try:
        assert not gc.isenabled() and gc.get_freeze_count() >= before
        collections.clear()
        for step in range(7):
            sched.before_step(step)
        assert len(collections) == 3  # steps 0, 3, 6
    finally:
        sched.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    sched.close()  # twice is harmless
    assert gc.isenabled()


def test_cpu_runs_and_interval_zero_keep_python_s_collector(monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    for sched in (ScheduledGC(interval=100, device="cpu"), ScheduledGC(interval=0, device="cuda")):
        assert gc.isenabled()
        sched.before_step(0)
        sched.close()
    assert collections == [] and gc.isenabled()
