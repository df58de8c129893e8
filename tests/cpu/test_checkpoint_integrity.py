"""Checkpoint integrity helpers on small files (no process group, no model).

A torch_dist directory is written by torch's own DCP writer (what megatron's strategy wraps) plus
megatron's `metadata.json` / `common.pt`, then damaged the ways disks and people damage it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_sft.conversion import mcore_io
from moe_sft.trainer import checkpoint_integrity as ci

HF_CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 688,
}


def _write_ckpt(path: Path, source: str = "/models/a", seed: int = 0, **config) -> Path:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(seed)
    state = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    path.mkdir(parents=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2), no_dist=True)
    (path / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    torch.save({"world_size": 1}, path / "common.pt")
    (path / "hf").mkdir()
    (path / "hf" / "config.json").write_text(json.dumps({**HF_CONFIG, **config}))
    mcore_io.write_meta(path, {"model_type": "qwen3_moe", "vocab_size": 688, "source": source})
    ci.write_checksums(path)  # last, as the trainer's commit: it covers the meta and hf/ too
    return path


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp"))


@pytest.fixture
def run(tmp_path):
    """checkpoints/step_0000001 and step_0000002 of a run, latest = 2."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _write_ckpt(root / f"step_{step:07d}", seed=step)
    (root / "latest").write_text("2")
    return root


def test_checksums_record_every_megatron_file(run):
    ckpt = run / "step_0000002"
    sums = ci.read_checksums(ckpt)
    assert set(sums) == {p.name for p in ckpt.iterdir() if p.is_file() and p.name != ci.CHECKSUM_FILE} | {
        "hf/config.json"
    }
    assert mcore_io.META_FILE in sums
    assert len(_shards(ckpt)) == 2 and all(sums[p.name]["size"] == p.stat().st_size for p in _shards(ckpt))
    assert ci.storage_problems(ckpt) == {}
    ci.verify_loadable(ckpt, "resume checkpoint", run, say=lambda _: None)  # intact: no error


@pytest.mark.parametrize(
    "damage, bad_file, why",
    [
        ("truncate_shard", "__0_1.distcp", "truncated"),
        ("delete_shard", "__0_0.distcp", "missing (listed in .metadata)"),
        ("delete_common", "common.pt", "missing"),
        ("garble_metadata_json", "metadata.json", "unreadable (JSONDecodeError"),
        ("garble_dot_metadata", ".metadata", "unreadable ("),
        ("flip_bit", "__0_1.distcp", "contents changed since the save"),
    ],
)
def test_damage_names_the_file_and_the_previous_complete_step(run, damage, bad_file, why):
    ckpt = run / "step_0000002"
    shard = _shards(ckpt)[-1]
    if damage == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "delete_shard":
        _shards(ckpt)[0].unlink()
    elif damage == "delete_common":
        (ckpt / "common.pt").unlink()
    elif damage == "garble_metadata_json":
        (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_di')
    elif damage == "garble_dot_metadata":
        data = bytearray((ckpt / ".metadata").read_bytes())
        (ckpt / ".metadata").write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "flip_bit":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10  # a float's exponent bit: 2.2e8 where 0.7 was
        shard.write_bytes(bytes(data))
    with pytest.raises(ci.CheckpointIntegrityError) as err:
        ci.verify_loadable(ckpt, "resume checkpoint", run, say=lambda _: None)
    msg = str(err.value)
    assert f"{bad_file}: {why}" in msg, msg
    assert "previous complete checkpoint is step 1" in msg and str(run / "latest") in msg, msg


def test_only_complete_steps_are_offered(run):
    (run / "step_0000001" / "common.pt").unlink()
    _write_ckpt(run / "step_0000003", seed=3)
    assert ci.complete_steps(run) == [2, 3] and ci.complete_steps(run, before=3) == [2]
    shutil.rmtree(run / "step_0000002")
    _shards(run / "step_0000003")[0].unlink()
    with pytest.raises(ci.CheckpointIntegrityError, match="no earlier complete checkpoint .* checkpoint.resume=never"):
        ci.verify_loadable(run / "step_0000003", "resume checkpoint", run, say=lambda _: None)


def test_base_checkpoint_without_checksums_gets_the_file_list_check(tmp_path):
    base = _write_ckpt(tmp_path / "mcore")
    (base / ci.CHECKSUM_FILE).unlink()  # as tools/convert_hf_to_mcore.py writes it
    said = []
    ci.verify_loadable(base, "model.mcore_path", say=said.append)
    assert said == []  # a converted checkpoint has no checksums: nothing to say
    shard = _shards(base)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        ci.CheckpointIntegrityError,
        match=r"model.mcore_path .*__0_0.distcp: truncated: 100 bytes.*"
        r"reconvert it",
    ):
        ci.verify_loadable(base, "model.mcore_path", say=said.append)


def test_an_older_checkpoint_without_checksums_loads_with_a_note(run):
    (run / "step_0000002" / ci.CHECKSUM_FILE).unlink()
    said = []
    ci.verify_loadable(run / "step_0000002", "resume checkpoint", run, say=said.append)
    assert len(said) == 1 and "no checksums.json" in said[0] and "without verifying" in said[0]


def test_files_are_shared_over_ranks_by_size():
    shares = ci._share({"a": 10, "b": 9, "c": 2, "d": 1, "e": 1}, 2)
    assert shares == [["a", "d", "e"], ["b", "c"]] or shares == [["a", "d"], ["b", "c", "e"]]
    assert sorted(sum(shares, [])) == list("abcde")


def test_resume_with_another_model_or_source(tmp_path):
    run = _write_ckpt(tmp_path / "run" / "step_0000002", source="/models/a")
    assert ci.check_same_model(run, _write_ckpt(tmp_path / "same", source="/models/a")) is None
    note = ci.check_same_model(run, _write_ckpt(tmp_path / "other_weights", source="/models/b"))
    assert note.startswith("warning: resuming from this run's own checkpoint") and "is not used" in note
    assert "/models/b" in note and "\n" not in note
    with pytest.raises(ci.CheckpointIntegrityError) as err:
        ci.check_same_model(run, _write_ckpt(tmp_path / "bigger", source="/models/c", hidden_size=256))
    msg = str(err.value)
    assert "hidden=128 vs 256" in msg and "new trainer.output_dir" in msg
    assert "point model.mcore_path back at /models/a" in msg


class _FakeDistOptimizer:
    """The attributes of megatron's DistributedOptimizer that hold fp32 state."""

    def __init__(self, model_params):
        self.model_float16_groups = [list(model_params)]
        self.shard_fp32_from_float16_groups = [[p.detach().float().clone() for p in model_params]]
        self.optimizer = SimpleNamespace(
            state={
                m: {"exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
                for m in self.shard_fp32_from_float16_groups[0]
            }
        )


def test_non_finite_parameters_main_params_and_moments_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).bfloat16()
    opt = _FakeDistOptimizer(list(model.parameters()))
    assert ci.non_finite_tensors([model], opt) == ([], 0)
    main = opt.shard_fp32_from_float16_groups[0]
    main[1][0] = float("inf")  # only the fp32 main copy of 0.bias
    opt.optimizer.state[main[2]]["exp_avg_sq"][0, 0] = float("nan")
    bad, checked = ci.non_finite_tensors([model], opt)
    assert bad == ["0.bias (fp32 main)", "1.weight (exp_avg_sq)"] and checked == 4 * 4
    with torch.no_grad():
        model[0].weight[1, 1] = float("nan")
    bad, _ = ci.non_finite_tensors([model], opt)
    assert "0.weight" in bad
    msg = ci.non_finite_message(3, bad, 16, Path("/nonexistent"), 1e38)
    assert "1 parameter tensor(s) and 2 fp32 main-parameter / Adam state tensor(s) of 16" in msg
    assert "0.weight" in msg and "Lower optimizer.lr (now 1e+38)" in msg and "No checkpoint of this run" in msg


def test_an_edited_model_config_or_meta_in_a_training_checkpoint_is_named(run):
    """The resume builds the model from the checkpoint's hf/config.json: an edited rope_theta
    would train silently on another model."""
    config = run / "step_0000002" / "hf" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_theta": 5e5}))
    with pytest.raises(ci.CheckpointIntegrityError) as err:
        ci.verify_loadable(run / "step_0000002", "resume checkpoint", run)
    msg = str(err.value)
    assert "step_0000002: hf/config.json changed after the save (hf/config.json: " in msg
    assert "Restore it" in msg and "previous complete checkpoint is step 1" in msg


def test_a_garbled_meta_in_a_training_checkpoint_names_the_previous_step(run):
    (run / "step_0000002" / mcore_io.META_FILE).write_text('{"family": "qwen3_m')
    with pytest.raises(ci.CheckpointIntegrityError) as err:
        ci.check_resume_meta(run)
    msg = str(err.value)
    assert f"step_0000002 is damaged ({mcore_io.META_FILE}: not valid JSON" in msg
    assert "previous complete checkpoint is step 1" in msg and "reconvert" not in msg
    ci.check_resume_meta(run.parent / "absent")  # no run yet: nothing to check
