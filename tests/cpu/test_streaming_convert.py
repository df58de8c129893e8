"""The streaming converter writes what the in-memory converter wrote, in bounded memory.

The reference is the converter moe-sft had before streaming (`_in_memory_convert`: build the whole
single-rank model, fill it, `dist_checkpointing.save`). Streamed checkpoints are written with tiny
chunks so nearly every tensor is split, then loaded back by megatron's own loader: at one rank
(bit-exact per tensor, three families incl. DeepSeek-V3's MTP layer and Mixtral's layer-stacked
keys) and resharded at TP=2 x EP=2 under torchrun. A conversion subprocess of a ~1.4 GB synthetic
checkpoint must stay far below the checkpoint's size above its import baseline.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moe_sft.conversion import fp8, mapping, mcore_io  # noqa: E402
from moe_sft.conversion.convert import convert  # noqa: E402
from moe_sft.conversion.export import load_model_from_checkpoint  # noqa: E402
from moe_sft.conversion.hf_reader import CheckpointError  # noqa: E402
from moe_sft.conversion.hf_source import prepare  # noqa: E402
from moe_sft.conversion.single_rank import single_rank_model  # noqa: E402
from moe_sft.conversion.streaming_reader import StreamingHFReader  # noqa: E402
from moe_sft.models import registry  # noqa: E402
from moe_sft.models import transforms as T  # noqa: E402
from moe_sft.runtime import cpu_compat  # noqa: E402
from tests import peak_rss  # noqa: E402
from tests.dist.launch import clean_env  # noqa: E402
from tests.safe_open_reader import SafeOpenHFReader  # noqa: E402

VOCAB = 300
TINY_CHUNK = 2048  # bytes: splits every tensor above 512 fp32 values into several chunks


def _in_memory_convert(hf: Path, out: Path) -> None:
    """The pre-streaming converter: whole model in memory, then megatron's own save."""
    from megatron.core import dist_checkpointing

    job = prepare(hf)
    model = single_rank_model(job.family, job.hf_cfg, job.precision)
    mapping.load_hf_into_state(job.entries, job.reader.get, job.ctx, model.state_dict())
    out.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out))
    mcore_io.copy_hf_side_files(hf, out / mcore_io.HF_SUBDIR)
    mcore_io.write_meta(out, dict(family=job.family.name, params_dtype=job.precision))


def _write_hf(name: str, path: Path) -> None:
    if name == "deepseek_v3_mtp":
        from tests.deepseek_mtp import write_tiny_deepseek_with_mtp

        write_tiny_deepseek_with_mtp(path, VOCAB)
        return
    family = registry.family_by_name(name)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = family.hf_model_class(family.tiny_hf_config(vocab_size=VOCAB)).eval()
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf))
        model.save_pretrained(str(path))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor: bit-exact comparison that NaN (uninitialised HF weights) cannot fool."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3_mtp", "mixtral"])
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    _write_hf(request.param, tmp / "hf")
    _in_memory_convert(tmp / "hf", tmp / "reference")
    convert(tmp / "hf", tmp / "streamed", max_chunk_bytes=TINY_CHUNK)
    convert(tmp / "hf", tmp / "default")
    return tmp


def test_streamed_checkpoint_loads_equal_to_the_in_memory_one(converted):
    reference = load_model_from_checkpoint(converted / "reference").state_dict()
    streamed = load_model_from_checkpoint(converted / "streamed").state_dict()
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    assert set(tensors) == {k for k, v in streamed.items() if isinstance(v, torch.Tensor)}
    unequal = [
        k
        for k in tensors
        if reference[k].dtype != streamed[k].dtype or not torch.equal(_bits(reference[k]), _bits(streamed[k]))
    ]
    assert unequal == []
    # The tiny chunks really split the tensors: many more chunks than megatron's own items.
    chunks = lambda md: sum(
        len(v.chunks)
        for v in md.state_dict_metadata.values()  # noqa: E731
        if hasattr(v, "chunks")
    )
    assert chunks(_metadata(converted / "streamed")) > 3 * chunks(_metadata(converted / "reference"))


def test_conversion_leaves_torchs_meta_device_context_working(converted):
    """The meta model must not leave the CPU-compat wrappers in torch's cached constructor set
    (transformers' from_pretrained builds models under `torch.device("meta")`)."""
    with cpu_compat.suspended(), torch.device("meta"):
        assert torch.empty(2).is_meta and torch.zeros(2).is_meta


def test_default_chunks_write_megatrons_own_layout(converted):
    """Below the chunk size nothing is split: same keys, shapes, dtypes and chunks as megatron's
    save, the same common.pt and metadata.json."""
    ref, ours = _metadata(converted / "reference"), _metadata(converted / "default")
    assert ref.state_dict_metadata.keys() == ours.state_dict_metadata.keys()
    for key, meta in ref.state_dict_metadata.items():
        assert ours.state_dict_metadata[key] == meta, key
    assert set(ref.storage_data) == set(ours.storage_data)
    for name in ("metadata.json", "common.pt"):
        assert (converted / "reference" / name).read_bytes() == (converted / "default" / name).read_bytes()


def test_expert_stacking_is_separable_per_expert():
    """tensor_source relies on it: expert e's HF tensors alone give block e of the megatron tensor."""
    g = torch.Generator().manual_seed(0)
    experts, ffn, hidden = 3, 5, 8
    ctx = dict(num_experts=experts)
    fc1_hf = [torch.randn(ffn, hidden, generator=g) for _ in range(2 * experts)]
    fc2_hf = [torch.randn(hidden, ffn, generator=g) for _ in range(experts)]
    for transform, hf, per in ((T.EXPERTS_FC1, fc1_hf, 2), (T.EXPERTS_FC2, fc2_hf, 1)):
        whole = transform.from_hf(hf, ctx).reshape(-1)
        blocks = [transform.from_hf(hf[e * per : (e + 1) * per], ctx).reshape(-1) for e in range(experts)]
        assert torch.equal(whole, torch.cat(blocks)), transform.name


def test_reader_matches_safetensors_without_mapping_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 260, generator=g)
    q, s = fp8.quantize_blocks(weight)
    tensors = {
        "a": torch.randn(7, 5, generator=g),
        "b": torch.randn(4, 3, 2, generator=g).bfloat16(),
        "c": torch.arange(6).reshape(2, 3),
        "d": torch.randn(9, generator=g).half(),
        "e": torch.tensor(3.0),
        "w.weight": q,
        "w.weight_scale_inv": s,
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ours, theirs = StreamingHFReader(tmp_path), SafeOpenHFReader(tmp_path)
    for name in ("a", "b", "c", "d", "e", "w.weight"):
        mine, ref = ours.get(name), theirs.get(name)
        assert mine.dtype == ref.dtype and mine.shape == ref.shape and torch.equal(mine, ref), name
    assert torch.equal(ours.get_rows("a", 2, 5), tensors["a"][2:5])
    assert torch.equal(ours.get_rows("b", 1, 4), tensors["b"][1:4])
    assert ours.row_shape("w.weight") is None and ours.row_shape("e") is None  # read whole
    # Truncated data behind an intact header (an index, so nothing opens the file up front).
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model.safetensors" for n in tensors}})
    )
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        reader = StreamingHFReader(tmp_path)
        for name in tensors:
            reader.get(name)


def test_failure_while_writing_leaves_no_directory(tmp_path):
    """An MTP copy that differs is found while its rows are written: the staging dir goes too."""
    from safetensors.torch import load_file

    from tests.deepseek_mtp import write_tiny_deepseek_with_mtp

    write_tiny_deepseek_with_mtp(tmp_path / "hf", VOCAB)
    extra = load_file(str(tmp_path / "hf" / "mtp.safetensors"))
    extra["model.layers.2.shared_head.head.weight"][-1] += 1.0  # the last row only
    save_file(extra, str(tmp_path / "hf" / "mtp.safetensors"))
    with pytest.raises(mapping.MappingError, match=r"shared_head\.head\.weight.*copies"):
        convert(tmp_path / "hf", tmp_path / "out", max_chunk_bytes=TINY_CHUNK)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.parametrize("converted", ["qwen3_moe"], indirect=True)  # a worker spends ~8 s importing
def test_two_worker_processes_write_one_checkpoint(converted, tmp_path):
    meta = convert(converted / "hf", tmp_path / "two", workers=2, max_chunk_bytes=TINY_CHUNK)
    files = sorted(p.name for p in (tmp_path / "two").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((tmp_path / "two").glob(".moe_sft_worker_*"))  # results and logs cleaned up
    assert meta["written_bytes"] == sum((tmp_path / "two" / f).stat().st_size for f in files)
    reference = load_model_from_checkpoint(converted / "reference").state_dict()
    streamed = load_model_from_checkpoint(tmp_path / "two").state_dict()
    assert all(torch.equal(_bits(v), _bits(streamed[k])) for k, v in reference.items() if isinstance(v, torch.Tensor))


def _convert_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), *args],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("converted", ["qwen3_moe"], indirect=True)
def test_two_nodes_write_one_checkpoint_into_shared_storage(converted, tmp_path):
    """Node 1 (a separate launch, as srun would start it) starts first and waits for node 0's
    stamp; node 0 publishes the checkpoint once node 1's share has arrived."""
    out = tmp_path / "nodes"
    node1 = _convert_cli(
        "--hf-path",
        str(converted / "hf"),
        "--output",
        str(out),
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--run-id",
        "job7.0",
        "--chunk-size",
        str(TINY_CHUNK),
    )
    try:
        convert(
            converted / "hf", out, max_chunk_bytes=TINY_CHUNK, nodes=2, node_rank=0, run_id="job7.0", node_timeout_s=300
        )
        assert node1.wait(timeout=300) == 0, node1.stdout.read()
    finally:
        node1.kill()
    assert "node 1's share: wrote" in node1.stdout.read()
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(out.glob(".moe_sft_*")) and not (tmp_path / "nodes.tmp").exists()
    reference = load_model_from_checkpoint(converted / "reference").state_dict()
    streamed = load_model_from_checkpoint(out).state_dict()
    assert all(torch.equal(_bits(v), _bits(streamed[k])) for k, v in reference.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("converted", ["qwen3_moe"], indirect=True)
def test_a_failed_node_fails_node_0_with_its_error(converted, tmp_path):
    """Node 1 reads a different (truncated) checkpoint copy: node 0 reports node 1's error, not a
    timeout, and leaves nothing behind."""
    import shutil

    broken = tmp_path / "hf_copy"
    shutil.copytree(converted / "hf", broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "nodes"
    node1 = _convert_cli(
        "--hf-path", str(broken), "--output", str(out), "--nodes", "2", "--node-rank", "1", "--run-id", "job8.0"
    )
    try:
        with pytest.raises(RuntimeError, match=r"worker 1 failed[\s\S]*truncated"):
            convert(converted / "hf", out, nodes=2, node_rank=0, run_id="job8.0", node_timeout_s=120)
        assert node1.wait(timeout=300) != 0
    finally:
        node1.kill()
    assert not out.exists() and not (tmp_path / "nodes.tmp").exists()


def test_multi_node_cli_refuses_a_missing_run_id(tmp_path):
    proc = _convert_cli("--hf-path", str(tmp_path), "--output", str(tmp_path / "o"), "--nodes", "2", "--node-rank", "1")
    assert proc.wait(timeout=120) == 2
    assert "--nodes > 1 needs --run-id" in proc.stdout.read()


RESHARD_SCRIPT = """
import sys, torch
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.kernels import install as kernels_install
from moe_sft.runtime import device as rdevice, distributed
from moe_sft.trainer.checkpoint import load_model_weights

reference, streamed = sys.argv[1], sys.argv[2]
rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ("test",)))
kernels_install.install()
rank, _ = distributed.init_process_group("cpu")
distributed.init_model_parallel(tp=2, ep=2, etp=1)
family, hf_cfg = load_hf_config(reference + "/hf")
opts = ModelOptions(transformer=dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, sequence_parallel=True))
states = []
for path in (reference, streamed):
    chunks = build_model_chunks(family, hf_cfg, build_transformer_config(family, hf_cfg, opts), opts)
    load_model_weights(path, chunks)
    states.append(chunks[0].state_dict())
bits = lambda t: t.contiguous().view(-1).view(torch.uint8)
names = [k for k, v in states[0].items() if isinstance(v, torch.Tensor) and v.numel()]
bad = [k for k in names if not torch.equal(bits(states[0][k]), bits(states[1][k]))]
print(f"RANK {rank}: {len(names)} tensors, unequal {bad}")
distributed.destroy()
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("converted", ["qwen3_moe"], indirect=True)  # torchrun takes ~15 s
def test_split_chunks_reshard_at_tp2_ep2(converted, tmp_path):
    """megatron's loader reads the split chunks at another layout (torchrun, 2 ranks, gloo)."""
    script = tmp_path / "reshard.py"
    script.write_text(textwrap.dedent(RESHARD_SCRIPT))
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(converted / "reference"),
            str(converted / "streamed"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = re.findall(r"RANK (\d): (\d+) tensors, unequal \[\]", proc.stdout)
    assert sorted(r for r, _ in lines) == ["0", "1"] and all(int(n) > 10 for _, n in lines)


MEASURE_CONVERT = """
def main():
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.hf_source import prepare
    from moe_sft.conversion.meta_model import meta_model

    hf, out, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    job = prepare(hf)
    meta_model(job.family, job.hf_cfg, job.precision)
    baseline = peak_rss()
    meta = convert(hf, out, max_chunk_bytes=chunk)
    print(json.dumps(dict(baseline=baseline, peak=peak_rss(), written=meta["written_bytes"],
                          seconds=meta["seconds"])))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_is_bounded_by_chunks_not_the_model(tmp_path):
    from moe_sft.conversion.synthetic import write_synthetic_checkpoint
    from moe_sft.models import qwen3_moe

    cfg = qwen3_moe.tiny_hf_config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=64,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    )
    size = write_synthetic_checkpoint(tmp_path / "hf", cfg, shard_bytes=500 * 10**6)
    assert 1.3e9 < size < 1.5e9
    chunk = 64 * 2**20
    result = peak_rss.measure(
        tmp_path,
        MEASURE_CONVERT,
        tmp_path / "hf",
        tmp_path / "mcore",
        chunk,
        label=f"checkpoint {size / 1e9:.2f} GB",
        timeout=300,
    )
    above = result["above"]
    assert result["written"] > 0.99 * size
    # A few 64 MiB chunks (source range + the chunk written), nowhere near the 1.4 GB model.
    assert above < 0.25 * size and above < 6 * chunk, result
