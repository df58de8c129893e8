"""moe_sft/trainer/row_capacity.py across ranks that do not all hold capped layers.

With pipeline parallelism a stage may hold only dense layers, so no capped static-row layer; the
re-run is still the whole step's, on every rank. So every rank of a run with the allgather
dispatcher at EP > 1 joins the same all-reduce of a per-layer (global layer number) excess and
gets the same verdict: a rank that skipped it would leave the others waiting forever."""

from __future__ import annotations

import datetime
import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, results) -> None:
    from moe_sft.kernels import permute
    from moe_sft.trainer.row_capacity import RowCapacity

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left out of the all-reduce fails the test in a minute instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        # rank 0: a stage with capped layers 3 and 4; rank 1: a stage of dense layers only
        dispatchers = [SimpleNamespace(moe_sft_excess=torch.tensor(0)) for _ in range(2)] if rank == 0 else []
        permute.capped_dispatchers = lambda chunks: list(zip((3, 4), dispatchers))
        capacity = RowCapacity([torch.nn.Linear(2, 2)], num_layers=4, collective=True)
        steps = []
        for excess in (0, 7):  # a step within the capacity, then one where layer 4 exceeded it
            capacity.before_step()
            if dispatchers:
                dispatchers[1].moe_sft_excess.fill_(excess)
            steps.append(capacity.overflows())
        results[rank] = (steps, [int(d.moe_sft_excess) for d in dispatchers])
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_same_verdict_also_one_without_capped_layers():
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(_free_port(), results), nprocs=2, start_method="spawn")
    verdict = [[], ["layer 4: 7 rows above the capacity"]]
    assert results[0] == (verdict, [0, 0])  # read, and cleared for the next step
    assert results[1] == (verdict, [])


def test_one_rank_without_capped_layers_watches_nothing(monkeypatch):
    from moe_sft.kernels import permute
    from moe_sft.trainer.row_capacity import RowCapacity

    monkeypatch.setattr(permute, "capped_dispatchers", lambda chunks: [])
    capacity = RowCapacity([torch.nn.Linear(2, 2)], num_layers=4, collective=False)
    capacity.before_step()
    assert not capacity.watching and capacity.overflows() == []
