"""The one logger: `[moe-sft]` lines on the current stdout from rank 0, per-rank lines on request."""

from __future__ import annotations

from moe_sft.runtime import logs
from moe_sft.runtime.logs import ALL_RANKS, get_logger


def test_rank_zero_lines_and_warnings_reach_the_current_stdout(capsys, monkeypatch):
    monkeypatch.setattr(logs, "process_rank", lambda: 0)
    log = get_logger("moe_sft.trainer.something")
    log.info("loaded weights from /x")
    log.warning("gradient norm exactly 0")
    log.info("cache built", extra=ALL_RANKS)
    assert capsys.readouterr().out.splitlines() == [
        "[moe-sft] loaded weights from /x",
        "[moe-sft] WARNING: gradient norm exactly 0",
        "[moe-sft rank 0] cache built",
    ]


def test_other_ranks_print_only_per_rank_lines(capsys, monkeypatch):
    monkeypatch.setattr(logs, "process_rank", lambda: 3)  # torch.distributed's rank, or else RANK
    log = get_logger(__name__)  # a name outside the package is put under it
    assert log.name == f"moe_sft.{__name__}"
    log.info("every rank computes this")
    log.warning("and this")
    log.info("only this rank knows this", extra=ALL_RANKS)
    assert capsys.readouterr().out.splitlines() == ["[moe-sft rank 3] only this rank knows this"]


def test_one_handler_however_often_it_is_asked_for(capsys, monkeypatch):
    monkeypatch.setattr(logs, "process_rank", lambda: 0)
    for _ in range(3):
        get_logger()
    get_logger().info("once")
    assert capsys.readouterr().out == "[moe-sft] once\n"


def test_the_rank_is_torchrun_s_before_a_process_group_exists(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "5")
    assert logs.process_rank() == (dist.get_rank() if dist.is_initialized() else 5)
