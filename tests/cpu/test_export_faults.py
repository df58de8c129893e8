"""Fault paths of the export (tools/export_mcore_to_hf.py and the trainer's end-of-run export):
nothing damaged is exported, nothing of the user's is deleted, and each failure is one line naming
the file and the fix (never a traceback):

- a checkpoint whose bytes differ from its checksums.json (one flipped byte) or whose files are
  truncated is refused before anything is written, naming the file and the previous complete step;
- --output equal to the checkpoint, a parent of it or inside it is refused even with --overwrite;
- the disk filling up during the export removes the partial export (exit 4);
- a user's file in the run's own `output_dir/hf` is never deleted: the export refuses, naming it,
  and the trainer says so before training.
"""

from __future__ import annotations

import errno
import os
import shutil
import textwrap
import types
from pathlib import Path

import pytest

from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.models import registry
from moe_sft.runtime import cpu_compat
from tests.scripts import load_tool


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 3] ^= 0x40  # a float's exponent bit in the middle of the tensor data
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE converted once, and a training run's checkpoints/step_0000001 and
    step_0000002 of it, saved with their checksums.json as the trainer saves them."""
    import torch

    from moe_sft.trainer import checkpoint_integrity

    family = registry.family_by_name("qwen3_moe")
    root = tmp_path_factory.mktemp("tiny")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        family.hf_model_class(family.tiny_hf_config(vocab_size=64, num_hidden_layers=1)).save_pretrained(
            str(root / "hf")
        )
    convert(root / "hf", root / "mcore")
    for step in ("step_0000001", "step_0000002"):
        shutil.copytree(root / "mcore", root / "run" / "checkpoints" / step)
        checkpoint_integrity.write_checksums(root / "run" / "checkpoints" / step)
    return root


@pytest.fixture
def run(tiny, tmp_path) -> Path:
    """A copy of the tiny training run's output_dir."""
    shutil.copytree(tiny / "run", tmp_path / "run")
    return tmp_path / "run"


def _trainer(out: Path):
    """What Trainer.export reads of a trainer (a full-model fp32 run writing into `out`)."""
    return types.SimpleNamespace(
        out=out,
        rt=types.SimpleNamespace(precision="fp32"),
        cfg=types.SimpleNamespace(peft=types.SimpleNamespace(method="none")),
    )


def test_a_flipped_byte_is_refused_naming_the_file_and_the_previous_step(run, tmp_path, capsys):
    step = run / "checkpoints" / "step_0000002"
    _flip_byte(step / "__0_0.distcp")
    with pytest.raises(
        CheckpointError,
        match=r"step_0000002 is damaged \(__0_0\.distcp: contents changed since the save \(CRC-32 .*\)\): "
        r"nothing was exported.* previous complete checkpoint is .*step_0000001",
    ):
        export(step, tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()

    tool = load_tool("export_mcore_to_hf.py")
    assert tool.main(["--mcore-path", str(step), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "__0_0.distcp: contents changed" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    export(run / "checkpoints" / "step_0000001", tmp_path / "out", dtype="fp32")  # the intact step exports


def test_the_trainers_export_of_a_damaged_checkpoint_is_one_error_line(run, capfd):
    """The trainer's end-of-run export and its "nothing to train; exporting" path (Trainer.export,
    in a process of its own)."""
    from moe_sft.trainer.trainer import Trainer

    step = run / "checkpoints" / "step_0000002"
    _flip_byte(step / "__0_0.distcp")
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"HF export .*__0_0\.distcp: contents changed since the save"):
        Trainer.export(_trainer(run), step)
    assert "Traceback" not in "".join(capfd.readouterr())
    assert not (run / "hf").exists()


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_truncated_checkpoint_names_the_file_and_the_fix(tiny, tmp_path, name):
    """A converted checkpoint (no checksums.json): the files megatron's .metadata lists are checked."""
    ckpt = tmp_path / "mcore"
    shutil.copytree(tiny / "mcore", ckpt)
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"mcore is damaged \({name}: .*\): nothing was exported.*reconvert"):
        export(ckpt, tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["itself", "parent", "inside", "its_hf"])
def test_an_output_overlapping_the_checkpoint_is_refused_even_with_overwrite(run, where, capsys):
    step = run / "checkpoints" / "step_0000002"
    out = {"itself": step, "parent": run, "inside": step / "export", "its_hf": step / "hf"}[where]
    before = _snapshot(run)
    with pytest.raises(CheckpointError, match=rf"^--output {out} .*--mcore-path {step}.*pick an --output outside"):
        export(step, out, dtype="fp32", overwrite=True)
    assert _snapshot(run) == before

    tool = load_tool("export_mcore_to_hf.py")
    assert tool.main(["--mcore-path", str(step), "--output", str(out), "--overwrite"]) == 2
    assert str(step) in capsys.readouterr().err
    assert _snapshot(run) == before


def _fill_disk_after(monkeypatch, budget: int) -> None:
    """os.pwrite of the export's writer fails with ENOSPC once `budget` bytes are written."""
    from moe_sft.conversion import hf_writer

    left = [budget]
    real = os.pwrite

    def pwrite(fd, data, offset):
        if len(data) > left[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= len(data)
        return real(fd, data, offset)

    monkeypatch.setattr(hf_writer.os, "pwrite", pwrite)


def test_disk_full_during_the_export_removes_the_partial_export(run, tmp_path, monkeypatch, capsys):
    step = run / "checkpoints" / "step_0000002"
    _fill_disk_after(monkeypatch, 300_000)
    with pytest.raises(CheckpointError, match=rf"no space left writing {tmp_path / 'out.tmp'} \(.* free of .*\): "):
        export(step, tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    tool = load_tool("export_mcore_to_hf.py")
    assert tool.main(["--mcore-path", str(step), "--output", str(tmp_path / "out")]) == 4
    assert "error: no space left writing" in capsys.readouterr().err


def test_disk_full_during_the_trainers_export_is_one_line_exit_4(run, tmp_path, monkeypatch, capfd):
    """The export runs in a process of its own: the disk fills there (a sitecustomize.py on its
    PYTHONPATH), and the trainer reports it as one line with the exit status of a full disk."""
    from moe_sft.trainer.trainer import Trainer

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import errno, os
            _real, _left = os.pwrite, [300_000]
            def _pwrite(fd, data, offset):
                if len(data) > _left[0]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                _left[0] -= len(data)
                return _real(fd, data, offset)
            os.pwrite = _pwrite
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"HF export of .*step_0000002.*: no space left writing .*hf\.tmp") as err:
        Trainer.export(_trainer(run), run / "checkpoints" / "step_0000002")
    assert getattr(err.value, "exit_code", 2) == 4
    assert "Traceback" not in "".join(capfd.readouterr())
    assert not (run / "hf").exists() and not (run / "hf.tmp").exists()


def test_a_users_file_in_the_runs_hf_dir_is_never_deleted(run, capfd):
    from moe_sft.trainer.trainer import Trainer

    step = run / "checkpoints" / "step_0000002"
    export(run / "checkpoints" / "step_0000001", run / "hf", dtype="fp32")  # the run's earlier export
    (run / "hf" / "notes.txt").write_text("my eval notes")
    with pytest.raises(CheckpointError, match=rf"{run / 'hf'} .*notes\.txt.*Move them out of"):
        export(step, run / "hf", dtype="fp32")
    assert (run / "hf" / "notes.txt").read_text() == "my eval notes"

    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"HF export .*notes\.txt"):
        Trainer.export(_trainer(run), step)
    assert "Traceback" not in "".join(capfd.readouterr())
    assert (run / "hf" / "notes.txt").read_text() == "my eval notes"

    shutil.rmtree(run / "hf")  # a directory holding only the user's file
    (run / "hf").mkdir()
    (run / "hf" / "notes.txt").write_text("my eval notes")
    with pytest.raises(CheckpointError, match=r"notes\.txt"):
        Trainer.export(_trainer(run), step)
    assert (run / "hf" / "notes.txt").read_text() == "my eval notes"

    (run / "hf" / "notes.txt").unlink()  # an empty hf/ is the trainer's to fill
    Trainer.export(_trainer(run), step)
    assert (run / "hf" / "config.json").is_file()


def test_the_pre_flight_names_a_users_file_in_the_runs_hf_dir(tmp_path):
    from moe_sft.config.load import load_recipe
    from moe_sft.plan.preflight import checkpoint_problems

    cfg = load_recipe("recipes/quickstart.yaml")
    cfg.model.mcore_path = ""
    cfg.trainer.output_dir = str(tmp_path / "run")
    assert checkpoint_problems(cfg) == []
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "notes.txt").write_text("mine")
    problems = checkpoint_problems(cfg)
    assert len(problems) == 1 and "notes.txt" in problems[0] and "trainer.export_hf_at_end" in problems[0]
    cfg.trainer.export_hf_at_end = False
    assert checkpoint_problems(cfg) == []


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_the_checkpoint_reader_names_a_truncated_file(tiny, tmp_path, name):
    """What reads a checkpoint without the export's check first (a LoRA run's base tensors for the
    PEFT adapter) names the damaged file instead of torch.load's bare EOFError."""
    import torch

    from moe_sft.conversion.dcp_reader import DistCheckpointReader

    ckpt = tmp_path / "mcore"
    shutil.copytree(tiny / "mcore", ckpt)
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{ckpt / name}.*(damaged|truncated)"):
        reader = DistCheckpointReader(ckpt)
        for key, md in reader.tensors().items():
            reader.read_into(key, (0,) * len(md.size), torch.empty(md.size, dtype=md.properties.dtype))
