"""--output is never silently destroyed: convert and export refuse a non-empty directory they did
not write (exit 2 from the tools, the directory left byte for byte) unless --overwrite; an empty
one is fine; an interrupted write's `<out>.tmp` is replaced, someone else's is not; the trainer's
own `<output_dir>/hf` is re-exported after a resumed run; exporting an interrupted save
(`step_N.tmp`) names the latest complete step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_sft.conversion import mcore_io
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.conversion.workers import RUN_STAMP
from moe_sft.models import registry
from moe_sft.runtime import cpu_compat
from tests.scripts import load_tool  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# The refusals are mcore_io.OutputDirError, a CheckpointError (the tools' exit 2); caught as the
# base class so that the test runs (and fails) against the code before the fix too.


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def _foreign(path: Path) -> dict:
    """A user's directory: 3 files, one of them in a sub directory."""
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text("my notes")
    (path / "b.bin").write_bytes(b"\x00\x01")
    (path / "sub" / "c.json").write_text("{}")
    return _snapshot(path)


def _tool(script: str):
    return load_tool(script)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE saved by transformers and converted once."""
    import torch

    family = registry.family_by_name("qwen3_moe")
    root = tmp_path_factory.mktemp("tiny")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        family.hf_model_class(family.tiny_hf_config(vocab_size=64, num_hidden_layers=1)).save_pretrained(
            str(root / "hf")
        )
    convert(root / "hf", root / "mcore")
    return root


def test_convert_refuses_a_foreign_or_converted_dir_and_leaves_it_intact(tiny, tmp_path):
    out = tmp_path / "mine"
    before = _foreign(out)
    with pytest.raises(
        CheckpointError,
        match=rf"^--output {out} is not empty: it holds 3 files: a\.txt, "
        r"b\.bin, sub/; pass --overwrite .* or pick another --output",
    ):
        convert(tiny / "hf", out)
    assert _snapshot(out) == before and not out.with_name("mine.tmp").exists()

    other = tmp_path / "other_model"  # another model's converted checkpoint
    shutil.copytree(tiny / "mcore", other)
    before = _snapshot(other)
    with pytest.raises(CheckpointError, match=rf"holds a moe-sft checkpoint of {tiny / 'hf'} \(qwen3_moe\)"):
        convert(tiny / "hf", other)
    assert _snapshot(other) == before


def test_convert_into_an_empty_dir_and_with_overwrite(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    assert convert(tiny / "hf", tmp_path / "empty")["family"] == "qwen3_moe"
    assert (tmp_path / "empty" / mcore_io.META_FILE).is_file()
    _foreign(tmp_path / "mine")
    convert(tiny / "hf", tmp_path / "mine", overwrite=True)
    assert not (tmp_path / "mine" / "a.txt").exists() and mcore_io.checkpoint_problems(tmp_path / "mine") == []


def test_an_interrupted_conversion_is_replaced_a_foreign_tmp_dir_is_not(tiny, tmp_path, capsys):
    out, staging = tmp_path / "out", tmp_path / "out.tmp"
    staging.mkdir()
    (staging / RUN_STAMP).write_text(f"job1.0\n{tiny / 'hf'}")
    (staging / "__0_0.distcp").write_bytes(b"half")
    convert(tiny / "hf", out)
    assert f"replacing {staging}: an interrupted conversion of {tiny / 'hf'} (run 'job1.0')" in capsys.readouterr().err
    assert mcore_io.checkpoint_problems(out) == [] and not staging.exists()

    out2 = tmp_path / "x"
    before = _foreign(tmp_path / "x.tmp")
    with pytest.raises(
        CheckpointError,
        match=r"x\.tmp \(where --output .*x is staged\) holds 3 files: .*"
        r"not an interrupted moe-sft write",
    ):
        convert(tiny / "hf", out2)
    assert _snapshot(tmp_path / "x.tmp") == before and not out2.exists()


def test_export_refuses_a_foreign_dir_accepts_empty_overwrite_and_its_training_run(tiny, tmp_path):
    out = tmp_path / "hf_out"
    before = _foreign(out)
    with pytest.raises(CheckpointError, match=rf"^--output {out} is not empty: it holds 3 files"):
        export(tiny / "mcore", out, dtype="fp32")
    assert _snapshot(out) == before
    export(tiny / "mcore", out, dtype="fp32", overwrite=True)
    assert not (out / "a.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert not any(out.glob(".moe_sft*"))  # the staging stamp is not published
    with pytest.raises(CheckpointError, match=r"holds an HF model \(qwen3_moe, 1 safetensors file\(s\)\)"):
        export(tiny / "mcore", out, dtype="fp32")  # a finished export is not replaced either
    (tmp_path / "empty").mkdir()
    export(tiny / "mcore", tmp_path / "empty", dtype="fp32")

    # The trainer exports <output_dir>/checkpoints/step_N into <output_dir>/hf, after a resume too.
    run = tmp_path / "run"
    shutil.copytree(tiny / "mcore", run / "checkpoints" / "step_0000002")
    export(run / "checkpoints" / "step_0000002", run / "hf", dtype="fp32")
    shutil.copytree(tiny / "mcore", run / "checkpoints" / "step_0000004")
    export(run / "checkpoints" / "step_0000004", run / "hf", dtype="fp32")
    assert (run / "hf" / "config.json").is_file()


def test_exporting_an_interrupted_save_names_the_latest_complete_step(tiny, tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    for step in ("step_0000002", "step_0000010"):
        shutil.copytree(tiny / "mcore", ckpts / step)
    shutil.copytree(tiny / "mcore", ckpts / "step_0000012.tmp", ignore=shutil.ignore_patterns(mcore_io.META_FILE))
    with pytest.raises(
        FileNotFoundError,
        match=rf"step_0000012\.tmp: an interrupted save \(step 12 was not "
        rf"committed\); export {ckpts / 'step_0000010'} \(the latest complete",
    ):
        export(ckpts / "step_0000012.tmp", tmp_path / "out")
    lone = tmp_path / "lone" / "step_0000003.tmp"
    lone.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"step 3 was not committed\); no complete step_N checkpoint"):
        export(lone, tmp_path / "out")


def test_both_tools_refuse_with_exit_2_and_overwrite(tiny, tmp_path, capsys):
    convert_tool, export_tool = _tool("convert_hf_to_mcore.py"), _tool("export_mcore_to_hf.py")
    out = tmp_path / "mine"
    before = _foreign(out)
    assert convert_tool.main(["--hf-path", str(tiny / "hf"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --output {out} is not empty: it holds 3 files: a.txt, b.bin, sub/; pass --overwrite "
        "(overwrite=True) to replace it, or pick another --output\n"
    )
    assert export_tool.main(["--mcore-path", str(tiny / "mcore"), "--output", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output {out} is not empty: it holds 3 files")
    assert _snapshot(out) == before

    assert convert_tool.main(["--hf-path", str(tiny / "hf"), "--output", str(out), "--overwrite"]) == 0
    assert mcore_io.checkpoint_problems(out) == []
    hf_out = tmp_path / "hf_mine"
    _foreign(hf_out)
    assert export_tool.main(["--mcore-path", str(out), "--output", str(hf_out), "--overwrite"]) == 0
    assert not (hf_out / "a.txt").exists() and (hf_out / "config.json").is_file()

    interrupted = tmp_path / "checkpoints" / "step_0000005.tmp"
    interrupted.mkdir(parents=True)
    assert export_tool.main(["--mcore-path", str(interrupted), "--output", str(tmp_path / "o")]) == 2
    assert "an interrupted save (step 5 was not committed)" in capsys.readouterr().err
