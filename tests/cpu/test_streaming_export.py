"""The streaming exporter writes what the whole-model exporter wrote, byte for byte, in bounded memory.

The reference is the exporter moe-sft had before streaming (`_whole_model_export`: load the whole
single-rank model with megatron's loader, `mapping.state_to_hf`, shards of `save_file`). Streamed
exports of three families (DeepSeek-V3 with an MTP layer, Mixtral's layer-stacked keys) are
compared file by file with it: from megatron's own layout, from the converter's 2 KB chunks read
in 4 KB units, and from a checkpoint megatron saved at TP=2 x EP=2 (torchrun). The completeness
gates are shown to fire, and an export subprocess of a ~0.75 GB checkpoint stays far below the
checkpoint's size above its import baseline.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moe_sft.conversion import completeness, export_plan, mapping, mcore_io  # noqa: E402
from moe_sft.conversion.convert import convert  # noqa: E402
from moe_sft.conversion.dcp_reader import DistCheckpointReader, IncompleteCheckpointError  # noqa: E402
from moe_sft.conversion.export import export, export_with_stats, load_model_from_checkpoint  # noqa: E402
from moe_sft.conversion.hf_source import load_hf_config  # noqa: E402
from moe_sft.conversion.hf_writer import StreamingSafetensorsWriter, WriteError  # noqa: E402
from moe_sft.conversion.mapping import MappingError  # noqa: E402
from moe_sft.models import transforms as T  # noqa: E402
from tests import peak_rss  # noqa: E402
from tests.cpu.test_streaming_convert import TINY_CHUNK, _write_hf  # noqa: E402
from tests.dist.launch import clean_env  # noqa: E402

SHARD = 1_000_000  # bytes: the tiny models span several shards


def _whole_model_export(ckpt: Path, out: Path, max_shard_bytes: int, dtype: str) -> None:
    """The pre-streaming exporter: whole model in memory, then shards of save_file."""
    from transformers import GenerationConfig

    model = load_model_from_checkpoint(ckpt)
    family, hf_cfg = model.moe_sft_family, model.moe_sft_hf_config
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    out.mkdir(parents=True)
    shards, pending, size = [], {}, 0
    for name, tensor in mapping.state_to_hf(
        mapping.expand(family, hf_cfg), model.state_dict(), mapping.transform_context(family, hf_cfg)
    ):
        nbytes = tensor.numel() * torch_dtype.itemsize
        if pending and size + nbytes > max_shard_bytes:
            shards.append(pending)
            pending, size = {}, 0
        pending[name] = tensor.to(torch_dtype).contiguous()
        size += nbytes
    shards.append(pending)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if "generation_config.json" not in mcore_io.copy_hf_side_files(ckpt / mcore_io.HF_SUBDIR, out):
        GenerationConfig.from_model_config(hf_cfg).save_pretrained(str(out))
    hf_cfg.dtype = torch_dtype
    hf_cfg.save_pretrained(str(out))


def _same_files(a: Path, b: Path) -> list[str]:
    """Names of files that differ (or exist on one side only); [] when the directories are equal."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    return [
        n
        for n in names
        if not ((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes())
    ]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3_mtp", "mixtral"])
def checkpoints(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    _write_hf(request.param, tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")  # megatron's own items
    convert(tmp / "hf", tmp / "chunked", max_chunk_bytes=TINY_CHUNK)  # nearly every tensor split
    _whole_model_export(tmp / "mcore", tmp / "reference", SHARD, "fp32")
    return tmp


def test_streamed_export_is_byte_identical_to_the_whole_model_export(checkpoints):
    export(checkpoints / "mcore", checkpoints / "streamed", max_shard_bytes=SHARD, dtype="fp32")
    assert _same_files(checkpoints / "reference", checkpoints / "streamed") == []
    shards = list((checkpoints / "reference").glob("*.safetensors"))
    assert len(shards) >= 3  # several shards, so the split and the index are compared too


def test_tiny_chunks_read_in_tiny_units_export_the_same_bytes(checkpoints):
    out, stats = export_with_stats(
        checkpoints / "chunked", checkpoints / "from_chunks", max_shard_bytes=SHARD, dtype="fp32", read_bytes=4096
    )
    assert _same_files(checkpoints / "reference", out) == []
    # Streamed in pieces: many more units than megatron tensors, each byte read once, no more.
    plan_params = len(mapping.expand(*load_hf_config(checkpoints / "chunked" / "hf")))
    assert stats.units > 4 * plan_params
    assert stats.file_bytes == stats.megatron_bytes == _tensor_bytes(checkpoints / "chunked")


def _tensor_bytes(ckpt: Path) -> int:
    reader = DistCheckpointReader(ckpt)
    return sum(md.size.numel() * md.properties.dtype.itemsize for md in reader.tensors().values())


@pytest.mark.parametrize("checkpoints", ["qwen3_moe"], indirect=True)
def test_bf16_export_is_byte_identical_and_loads_in_transformers(checkpoints, tmp_path):
    import transformers

    from moe_sft.runtime import cpu_compat

    _whole_model_export(checkpoints / "mcore", tmp_path / "reference", SHARD, "bf16")
    export(checkpoints / "chunked", tmp_path / "streamed", max_shard_bytes=SHARD, dtype="bf16", read_bytes=4096)
    assert _same_files(tmp_path / "reference", tmp_path / "streamed") == []
    with cpu_compat.suspended():
        _, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "streamed"), output_loading_info=True
        )
    assert {k: sorted(v) for k, v in info.items() if v} == {}


# ------------------------------------------------------------------------------------------------
# A checkpoint megatron itself saved at another layout (TP=2 x EP=2, torchrun, gloo)
# ------------------------------------------------------------------------------------------------

SAVE_AT_LAYOUT = """
import pathlib, sys, torch
from megatron.core import dist_checkpointing
from moe_sft.conversion import mcore_io
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.kernels import install as kernels_install
from moe_sft.runtime import device as rdevice, distributed
from moe_sft.trainer.checkpoint import load_model_weights, model_sharded_state


def main(source, out):
    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ("test",)))
    kernels_install.install()
    rank, _ = distributed.init_process_group("cpu")
    distributed.init_model_parallel(tp=2, ep=2, etp=1)
    family, hf_cfg = load_hf_config(source / "hf")
    opts = ModelOptions(transformer=dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                     expert_tensor_parallel_size=1, sequence_parallel=True))
    chunks = build_model_chunks(family, hf_cfg, build_transformer_config(family, hf_cfg, opts), opts)
    load_model_weights(source, chunks)
    if rank == 0:
        out.mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save(model_sharded_state(chunks), str(out))
    if rank == 0:
        mcore_io.copy_hf_side_files(source / "hf", out / "hf")
        mcore_io.write_meta(out, mcore_io.read_meta(source))
    distributed.destroy()


if __name__ == "__main__":  # megatron's save starts a multiprocessing manager (spawn)
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
"""


@pytest.mark.parametrize("checkpoints", ["qwen3_moe"], indirect=True)  # torchrun takes ~20 s
def test_checkpoint_saved_by_megatron_at_tp2_ep2_exports_the_same_bytes(checkpoints, tmp_path):
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(SAVE_AT_LAYOUT))
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    saved = tmp_path / "tp2_ep2"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(checkpoints / "mcore"),
            str(saved),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(saved / ".metadata", "rb") as f:
        stored = pickle.load(f).state_dict_metadata
    # Really another layout: QKV in two TP halves, each layer's experts in two EP halves.
    assert len(stored["decoder.layers.0.self_attention.linear_qkv.weight"].chunks) == 2
    fc2 = stored["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    assert sorted(c.offsets[0] for c in fc2.chunks) == [0, 4]
    export(saved, tmp_path / "streamed", max_shard_bytes=SHARD, dtype="fp32", read_bytes=8192)
    assert _same_files(checkpoints / "reference", tmp_path / "streamed") == []


# ------------------------------------------------------------------------------------------------
# Completeness gates: nothing silently missing, nothing written then
# ------------------------------------------------------------------------------------------------


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    with open(dst / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata.state_dict_metadata)
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return dst


def _export_fails(ckpt: Path, out: Path, error, *fragments) -> str:
    with pytest.raises(error) as info:
        export(ckpt, out, dtype="fp32")
    missing = [f for f in fragments if f not in str(info.value)]
    assert missing == [], f"{missing} not in: {info.value}"
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    return str(info.value)


EXPERT_KEY = "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"


@pytest.mark.parametrize("checkpoints", ["qwen3_moe"], indirect=True)
def test_a_missing_expert_chunk_is_an_error_naming_it(checkpoints, tmp_path, capsys):
    def drop_last_chunk(state):
        state[EXPERT_KEY].chunks.pop()

    ckpt = _edited_copy(checkpoints / "chunked", tmp_path / "ckpt", drop_last_chunk)
    _export_fails(ckpt, tmp_path / "out", IncompleteCheckpointError, EXPERT_KEY, "do not cover")
    # the box reader refuses too, whatever asks it
    reader = DistCheckpointReader(ckpt)
    size = tuple(reader.tensors()[EXPERT_KEY].size)
    with pytest.raises(IncompleteCheckpointError, match="cover"):
        reader.read_into(EXPERT_KEY, (0, 0, 0), torch.empty(size))
    # and the tool says so in one line, exit status 2
    tool = _export_tool()
    status = tool.main(["--mcore-path", str(ckpt), "--output", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and EXPERT_KEY in err
    assert not (tmp_path / "cli").exists() and not (tmp_path / "cli.tmp").exists()


def _export_tool():
    from tests.scripts import load_tool

    return load_tool("export_mcore_to_hf.py")


@pytest.mark.parametrize("checkpoints", ["qwen3_moe"], indirect=True)
def test_a_model_tensor_nobody_exports_is_an_error_optimizer_state_is_not(checkpoints, tmp_path):
    extra = "decoder.layers.1.mlp.experts.experts.linear_fc3.weight"

    def add(name):
        return lambda state: state.__setitem__(name, state[EXPERT_KEY])

    ckpt = _edited_copy(checkpoints / "mcore", tmp_path / "extra", add(extra))
    _export_fails(ckpt, tmp_path / "out", MappingError, extra, "would not write")
    ckpt = _edited_copy(checkpoints / "mcore", tmp_path / "optim", add("optimizer.state.exp_avg." + EXPERT_KEY))
    export(ckpt, tmp_path / "ok", max_shard_bytes=SHARD, dtype="fp32")
    assert _same_files(checkpoints / "reference", tmp_path / "ok") == []


@pytest.mark.parametrize("checkpoints", ["qwen3_moe"], indirect=True)
def test_a_mapping_without_the_expert_down_rule_is_refused(checkpoints, tmp_path, monkeypatch):
    import dataclasses

    from moe_sft.models import registry

    family, _ = load_hf_config(checkpoints / "mcore" / "hf")
    crippled = dataclasses.replace(
        family, rules=lambda cfg: [r for r in family.rules(cfg) if r.transform is not T.EXPERTS_FC2]
    )
    monkeypatch.setattr(registry, "family_for_model_type", lambda *args, **kwargs: crippled)
    _export_fails(
        checkpoints / "mcore",
        tmp_path / "out",
        MappingError,
        "decoder.layers.1.mlp.experts.weight2",
        "decoder.layers.0.mlp.experts.weight2",
    )


def test_hf_names_gate_lists_what_transformers_expects(checkpoints):
    family, hf_cfg = load_hf_config(checkpoints / "mcore" / "hf")
    plan = export_plan.build(family, hf_cfg, DistCheckpointReader(checkpoints / "mcore"))
    planned = plan.hf_specs()
    expected = completeness.hf_expected(family, hf_cfg)
    # Not vacuous: transformers' own names include every expert's on-disk tensors.
    experts = [n for n in expected if re.search(r"experts\.7\.", n)]
    assert len(experts) >= 3 and set(experts) <= {n for n, _ in planned}
    mtp = {n for n, _ in planned} - set(expected)
    if family.num_mtp_layers(hf_cfg):
        assert mtp and all(n.startswith(f"model.layers.{hf_cfg.num_hidden_layers}.") for n in mtp)
    else:
        assert mtp == set()
    lost = experts[0]
    with pytest.raises(MappingError, match=re.escape(lost)):
        completeness.check_hf_names(family, hf_cfg, [s for s in planned if s[0] != lost])
    with pytest.raises(MappingError, match="does not have: model.layers.0.mlp.experts.99"):
        completeness.check_hf_names(family, hf_cfg, planned + [("model.layers.0.mlp.experts.99.w", (1,))])
    wrong = [(n, (1,) + s if n == lost else s) for n, s in planned]
    with pytest.raises(MappingError, match="shapes differ"):
        completeness.check_hf_names(family, hf_cfg, wrong)


# ------------------------------------------------------------------------------------------------
# Pieces: the box reader, per-expert transforms, the writer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoints", ["mixtral"], indirect=True)
def test_boxes_read_from_the_files_equal_dcps_own_reads(checkpoints):
    """Random boxes, into contiguous and strided destinations, read by preadv vs DCP's read_data."""
    fast, slow = DistCheckpointReader(checkpoints / "chunked"), DistCheckpointReader(checkpoints / "chunked")
    slow._stored_tensor = lambda item: None  # every overlap through torch.load + copy
    g = torch.Generator().manual_seed(0)
    for key, md in fast.tensors().items():
        for trial in range(3):
            offsets = [int(torch.randint(0, n, (), generator=g)) for n in md.size]
            sizes = [int(torch.randint(1, n - o + 1, (), generator=g)) for n, o in zip(md.size, offsets)]
            padded = torch.full([s + 2 for s in sizes], float("nan"))
            ours = padded[tuple(slice(1, 1 + s) for s in sizes)] if trial else torch.empty(sizes)
            theirs = torch.empty(sizes)
            fast.read_into(key, offsets, ours)
            slow.read_into(key, offsets, theirs)
            assert torch.equal(ours, theirs), (key, offsets, sizes)
    assert fast.file_bytes < slow.file_bytes  # DCP loads each overlapped chunk whole


def test_expert_stacks_give_each_experts_hf_tensors_from_its_block_alone():
    """The exporter relies on it: block e of weight1/weight2 alone gives expert e's HF tensors."""
    g = torch.Generator().manual_seed(0)
    experts, ffn, hidden = 3, 5, 8
    for transform, shape in ((T.EXPERTS_FC1, (hidden, experts * 2 * ffn)), (T.EXPERTS_FC2, (experts * ffn, hidden))):
        whole = torch.randn(shape, generator=g)
        block_shape = transform.expert_block(shape, experts)
        flat = whole.view(-1).view(experts, -1)
        per_expert = [
            t for e in range(experts) for t in transform.to_hf(flat[e].view(block_shape), dict(num_experts=1))
        ]
        reference = transform.to_hf(whole, dict(num_experts=experts))
        assert len(per_expert) == len(reference)
        assert all(torch.equal(a, b) for a, b in zip(per_expert, reference)), transform.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writer_files_are_save_files_bytes(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.10.w": torch.randn(3, 4, generator=g),
        "model.layers.9.w": torch.randn(5, generator=g),
        "b": torch.randn(7, 2, generator=g),
        "a.empty": torch.randn(0, 3, generator=g),
        "lm_head.weight": torch.randn(6, 4, generator=g),
        "scalar": torch.tensor(1.5),
    }
    specs = [(n, tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingSafetensorsWriter(tmp_path / "out", specs, dtype, max_shard_bytes=60)
    writer.write_rows("lm_head.weight", 4, tensors["lm_head.weight"][4:])  # rows in any order
    for name, tensor in reversed(tensors.items()):
        if name == "lm_head.weight":
            writer.write_rows(name, 0, tensor[:4])
        else:
            writer.write(name, tensor)
    out = writer.close()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (tmp_path / "out.tmp").exists()
    for file in files:
        names = [n for n, f in index["weight_map"].items() if f == file]
        save_file(
            {n: tensors[n].to(dtype) for n in names}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"}
        )
        assert (out / file).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), file
        with safe_open(str(out / file), framework="pt") as f:
            assert all(torch.equal(f.get_tensor(n), tensors[n].to(dtype)) for n in names)


def test_writer_refuses_twice_and_missing_and_leaves_nothing(tmp_path):
    specs = [("a", (4, 2)), ("b", (3,))]
    writer = StreamingSafetensorsWriter(tmp_path / "out", specs, torch.float32)
    writer.write_rows("a", 0, torch.zeros(3, 2))
    with pytest.raises(WriteError, match="'a' written twice"):
        writer.write_rows("a", 2, torch.zeros(2, 2))
    with pytest.raises(WriteError, match="not planned"):
        writer.write("c", torch.zeros(1))
    writer.write("b", torch.zeros(3))
    with pytest.raises(WriteError, match="not \\(completely\\) written: a"):
        writer.close()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_both_tools_share_one_size_parser():
    from moe_sft.conversion.sizes import parse_size

    tool = _export_tool()
    assert tool.parse_size is parse_size
    assert (parse_size("256MiB"), parse_size("1.5GB"), parse_size("2TiB")) == (256 * 2**20, 1_500_000_000, 2 * 2**40)
    for bad in ("0", "5 parsecs", ""):
        with pytest.raises(ValueError, match="expected a positive number"):
            parse_size(bad)
    text = (REPO / "tools" / "convert_hf_to_mcore.py").read_text()
    assert "from moe_sft.conversion.sizes import parse_size" in text and "_UNITS" not in text


# ------------------------------------------------------------------------------------------------
# Memory: far below the checkpoint
# ------------------------------------------------------------------------------------------------

MEASURE_EXPORT = """
def main():
    from moe_sft.conversion import export_plan
    from moe_sft.conversion.hf_source import load_hf_config
    from moe_sft.conversion.dcp_reader import DistCheckpointReader
    from moe_sft.conversion.export import export_with_stats

    ckpt, out, read = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    family, hf_cfg = load_hf_config(ckpt / "hf")
    export_plan.build(family, hf_cfg, DistCheckpointReader(ckpt), read)  # imports + meta models
    baseline = peak_rss()
    _, stats = export_with_stats(ckpt, out, max_shard_bytes=200 * 10**6, dtype="bf16", read_bytes=read)
    print(json.dumps(dict(baseline=baseline, peak=peak_rss(), written=stats.written_bytes,
                          seconds=stats.seconds, units=stats.units)))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_is_bounded_by_the_read_size_not_the_model(tmp_path):
    from moe_sft.conversion.synthetic import write_synthetic_checkpoint
    from moe_sft.models import qwen3_moe

    cfg = qwen3_moe.tiny_hf_config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    )
    size = write_synthetic_checkpoint(tmp_path / "hf", cfg, shard_bytes=300 * 10**6)
    assert 0.7e9 < size < 0.8e9
    convert(tmp_path / "hf", tmp_path / "mcore")  # 256 MiB chunks: an expert half is one item
    read = 16 * 2**20
    result = peak_rss.measure(
        tmp_path, MEASURE_EXPORT, tmp_path / "mcore", tmp_path / "out", read, label=f"checkpoint {size / 1e9:.2f} GB"
    )
    above = result["above"]
    assert result["written"] == size
    # One 16 MiB unit buffer (+~4 MiB), nowhere near the 0.75 GB model (nor its 200 MB expert
    # items). A fresh tensor per unit went to +177 MiB in 1 run of ~6 (glibc kept freed units).
    assert above < 0.1 * size and above < 2 * read, result
    # The bytes are the source's: one expert's down projection and the embedding, via mmap.
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    source = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("model.layers.2.mlp.experts.63.down_proj.weight", "model.embed_tokens.weight"):
        with (
            safe_open(str(tmp_path / "out" / index[name]), "pt") as ours,
            safe_open(str(tmp_path / "hf" / source[name]), "pt") as theirs,
        ):
            assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name)), name
