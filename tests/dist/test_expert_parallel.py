"""EP=2 x DP=2 on two CPU ranks (gloo, allgather dispatcher) runs the quickstart model and its
first steps match one rank: the forward pass and the first Adam update are layout-independent.

Full layout equivalence (every step, grad norms) is issue 4's; measured today: steps 1-2 equal to
4 digits, step 3 6.226 (EP2) vs 6.216 (1 rank). The cause is the padding, not the layout: the
allgather dispatcher needs equal shapes, so micro-batches are padded to pack_length, and padding
tokens reach the router's aux loss (one rank padded the same way has EP2's grad norm, 7.504 vs
6.558 unpadded)."""

from __future__ import annotations

import sys

import pytest

from tests.dist.test_quickstart_e2e import REPO, losses  # noqa: F401  (shared helpers)


def _run(tmp, nproc, extra=()):
    import os
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "moe_sft.train", "--config-path", "recipes", "--config-name", "quickstart",
           "trainer.max_steps=2", "trainer.log_interval=1", "trainer.export_hf_at_end=false",
           f"trainer.output_dir={tmp / f'run{nproc}'}", f"model.hf_path={tmp / 'hf'}",
           f"model.mcore_path={tmp / 'mcore'}", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return losses(proc.stdout)


def test_ep2_dp2_first_steps_match_one_rank(tmp_path):
    one = _run(tmp_path, 1)
    two = _run(tmp_path, 2, ["parallel.expert_model_parallel_size=2"])
    assert sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step] == pytest.approx(one[step], rel=2e-4), (one, two)
