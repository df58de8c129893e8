"""HF ↔ megatron conversion of a tiny random Qwen3-MoE: completeness, bit-exact round trips,
fp32 logit parity with transformers (packed documents included), clear errors, the two CLIs.

One module-scoped fixture builds, converts and exports the model once; the rest reuse it.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
# tests/conftest.py does this too, but pytest skips it when run as `pytest /abs/path/tests/cpu/...`
# from outside the repo (rootdir, hence confcutdir, becomes tests/cpu).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import transformers  # noqa: E402

from moe_sft.conversion import completeness, mapping  # noqa: E402
from moe_sft.conversion.convert import convert  # noqa: E402
from moe_sft.conversion.export import export, load_model_from_checkpoint  # noqa: E402
from moe_sft.conversion.hf_reader import CheckpointError  # noqa: E402
from moe_sft.conversion.mapping import MappingError  # noqa: E402
from moe_sft.conversion.verify import verify  # noqa: E402
from moe_sft.models import qwen3_moe, registry  # noqa: E402
from moe_sft.models import transforms as T  # noqa: E402
from moe_sft.models.family import UnsupportedConfigError  # noqa: E402
from moe_sft.models.forward import packed_logits  # noqa: E402
from moe_sft.runtime import cpu_compat, distributed  # noqa: E402
from tests.scripts import load_tool  # noqa: E402

FAMILY = qwen3_moe.FAMILY
VOCAB = 300  # not a multiple of 128: megatron's embedding is padded to 384 rows
PADDED_VOCAB = 384
DOC_LENGTHS = (17, 33, 9)
# Sum of the tiny model's parameter counts × 4 bytes: embed+lm_head 2·300·128, final norm 128,
# per layer 443_712 (norms 256, q/o 2·128², k/v 2·64·128, q/k norm 64, router 8·128, experts 8·3·128²).
TINY_FP32_BYTES = 3_857_408


def _new_hf_model(cfg, seed: int, save_to: Path):
    """A random fp32 HF model, saved; HF code runs with torch unpatched (see cpu_compat.suspended)."""
    with cpu_compat.suspended():
        torch.manual_seed(seed)
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
        model.save_pretrained(str(save_to))
    return model


def _hf_logits(model, tokens):
    with cpu_compat.suspended(), torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _read_dir(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _docs(vocab, lengths=DOC_LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversion")
    cfg = qwen3_moe.tiny_hf_config(vocab_size=VOCAB)
    hf_model = _new_hf_model(cfg, seed=0, save_to=root / "hf")
    meta = convert(root / "hf", root / "mcore")
    # 1 MB shards: the 3.9 MB model spans several files, so the index is exercised.
    export(root / "mcore", root / "export", max_shard_bytes=1_000_000, dtype="fp32")
    yield SimpleNamespace(
        root=root,
        cfg=cfg,
        hf=root / "hf",
        mcore=root / "mcore",
        exported=root / "export",
        meta=meta,
        hf_model=hf_model,
        tensors=_read_dir(root / "hf"),
    )
    distributed.destroy()  # leave no process group behind for other test modules


# ------------------------------------------------------------------------------------------------
# Mapping completeness
# ------------------------------------------------------------------------------------------------


def test_every_hf_tensor_is_in_exactly_one_entry(tiny):
    entries = mapping.expand(FAMILY, tiny.cfg)
    counts = Counter(name for e in entries for name in e.hf)
    assert set(counts) == set(tiny.tensors)
    assert set(counts.values()) == {1}
    # 2 layers × 9 megatron tensors + embedding, final norm, output layer; 69 HF tensors.
    assert (len(entries), len(counts), tiny.meta["hf_tensors"]) == (21, 69, 69)
    fc1 = next(e for e in entries if e.mcore == "decoder.layers.1.mlp.experts.weight1")
    assert fc1.hf[:3] == (
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
    )
    assert len(fc1.hf) == 16 and fc1.transform is T.EXPERTS_FC1


def test_every_megatron_parameter_is_produced(tiny):
    model = load_model_from_checkpoint(tiny.mcore)
    state = model.state_dict()
    produced = {e.mcore for e in mapping.expand(FAMILY, tiny.cfg)}
    assert mapping.model_parameter_names(state) == produced
    # Dropping one entry must be caught by the gate, naming the parameter left unproduced.
    entries = [
        e for e in mapping.expand(FAMILY, tiny.cfg) if e.mcore != "decoder.layers.0.self_attention.q_layernorm.weight"
    ]
    ctx = mapping.transform_context(FAMILY, tiny.cfg)
    with pytest.raises(MappingError, match=r"decoder\.layers\.0\.self_attention\.q_layernorm\.weight"):
        mapping.load_hf_into_state(entries, tiny.tensors.__getitem__, ctx, state)


def test_dropped_list_is_respected(tiny):
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    names = set(tiny.tensors) | {extra}
    entries = mapping.expand(FAMILY, tiny.cfg)
    assert FAMILY.dropped == ()  # Qwen3-MoE checkpoints carry nothing to drop
    with pytest.raises(MappingError, match=re.escape(extra)):
        completeness.check_hf_coverage(FAMILY, entries, names)
    dropping = dataclasses.replace(FAMILY, dropped=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))
    completeness.check_hf_coverage(dropping, entries, names)  # accepted: listed as dropped
    # A dropped pattern must not excuse a tensor the mapping needs but the checkpoint lacks.
    with pytest.raises(MappingError, match=r"model\.norm\.weight"):
        completeness.check_hf_coverage(dropping, entries, names - {"model.norm.weight"})


# ------------------------------------------------------------------------------------------------
# Bit-exact round trip and the exported directory
# ------------------------------------------------------------------------------------------------


def test_round_trip_is_bit_exact(tiny):
    exported = _read_dir(tiny.exported)
    assert set(exported) == set(tiny.tensors)
    unequal = [n for n, t in tiny.tensors.items() if exported[n].dtype != t.dtype or not torch.equal(exported[n], t)]
    assert unequal == []


def test_padded_vocab_rows_stay_in_megatron(tiny):
    state = load_model_from_checkpoint(tiny.mcore).state_dict()
    for mcore_name, hf_name in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ):
        assert tuple(state[mcore_name].shape) == (PADDED_VOCAB, 128)
        assert torch.equal(state[mcore_name][:VOCAB], tiny.tensors[hf_name])
        assert torch.count_nonzero(state[mcore_name][VOCAB:]).item() == 0
    assert tiny.meta["padded_vocab_size"] == PADDED_VOCAB and tiny.meta["vocab_size"] == VOCAB
    shapes = {n: tuple(t.shape) for n, t in _read_dir(tiny.exported).items()}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (VOCAB, 128)


def test_index_json_matches_the_shards(tiny):
    index = json.loads((tiny.exported / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in tiny.exported.glob("*.safetensors"))
    assert len(files) == 4 and files[0] == "model-00001-of-00004.safetensors"
    for file in files:
        with safe_open(str(tiny.exported / file), framework="pt") as handle:
            assert set(handle.keys()) == {n for n, f in index["weight_map"].items() if f == file}
    assert set(index["weight_map"]) == set(tiny.tensors)
    assert index["metadata"]["total_size"] == TINY_FP32_BYTES
    assert sum(t.numel() * 4 for t in tiny.tensors.values()) == TINY_FP32_BYTES


def test_exported_dir_loads_in_transformers_with_same_logits(tiny):
    with cpu_compat.suspended():
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tiny.exported), dtype=torch.float32, output_loading_info=True
        )
    assert {k: sorted(v) for k, v in info.items() if v} == {}  # nothing missing/unexpected/mismatched
    assert type(loaded) is transformers.Qwen3MoeForCausalLM
    doc = _docs(VOCAB, (40,))[0]
    assert torch.equal(_hf_logits(loaded.eval(), doc), _hf_logits(tiny.hf_model, doc))
    gen = json.loads((tiny.exported / "generation_config.json").read_text())
    assert gen == json.loads((tiny.hf / "generation_config.json").read_text())  # copied verbatim


# ------------------------------------------------------------------------------------------------
# Transforms: pure inverse pairs
# ------------------------------------------------------------------------------------------------

# G=2 query groups, R=3 query heads per group, D=4 head dim, H=8 hidden, E=3 experts, F=5 ffn.
CTX = dict(num_query_groups=2, head_dim=4, num_experts=3, vocab_size=10, padded_vocab_size=16, num_mtp_layers=2)
G, R, D, H, E, F = 2, 3, 4, 8, 3, 5


def _hf_inputs(name: str, g: torch.Generator) -> list[torch.Tensor]:
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "identity": lambda: [r(7, H)],
        "qkv_interleave": lambda: [r(G * R * D, H), r(G * D, H), r(G * D, H)],
        "qkv_bias_interleave": lambda: [r(G * R * D), r(G * D), r(G * D)],
        "gate_up_fuse": lambda: [r(F, H), r(F, H)],
        "experts_gate_up_stack": lambda: [r(F, H) for _ in range(2 * E)],
        "experts_down_stack": lambda: [r(H, F) for _ in range(E)],
        "pad_vocab": lambda: [r(10, H)],
        "pad_vocab_mtp_shared": lambda: (lambda t: [t, t.clone(), t.clone()])(r(10, H)),  # main + 2 MTP copies
    }[name]()


def test_mtp_copies_that_differ_are_refused():
    main = torch.randn(10, H)
    with pytest.raises(T.CopiesDifferError, match=r"positions \[2\]"):
        T.PAD_VOCAB_MTP_SHARED.from_hf([main, main.clone(), main + 1], CTX)


@pytest.mark.parametrize("transform", T.ALL_TRANSFORMS, ids=lambda t: t.name)
def test_transform_round_trips_bit_exactly(transform):
    g = torch.Generator().manual_seed(7)
    hf = _hf_inputs(transform.name, g)  # KeyError here: a new transform needs a case above
    mcore = transform.from_hf(hf, CTX)
    back = transform.to_hf(mcore, CTX)
    assert len(back) == len(hf)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(hf, back))
    # The other direction too: a megatron tensor survives to_hf → from_hf unchanged.
    assert torch.equal(transform.from_hf(transform.to_hf(mcore, CTX), CTX), mcore)


def test_transform_layouts_match_megatron():
    g = torch.Generator().manual_seed(3)
    q, k, v = _hf_inputs("qkv_interleave", g)
    qkv = T.QKV_INTERLEAVE.from_hf([q, k, v], CTX)
    # Group 1's block starts after group 0's R query heads, its k head and its v head.
    block = (R + 2) * D
    assert torch.equal(qkv[: R * D], q[: R * D]) and torch.equal(qkv[R * D : (R + 1) * D], k[:D])
    assert torch.equal(qkv[(R + 1) * D : block], v[:D]) and torch.equal(qkv[block : block + R * D], q[R * D :])
    fc1 = T.EXPERTS_FC1.from_hf(ups := _hf_inputs("experts_gate_up_stack", g), CTX)
    assert tuple(fc1.shape) == (H, E * 2 * F)
    w1_EH2F = fc1.view(E, H, 2 * F)  # how GroupedMLP reads weight1
    assert torch.equal(w1_EH2F[2], torch.cat([ups[4], ups[5]]).t())
    downs = _hf_inputs("experts_down_stack", g)
    w2_EFH = T.EXPERTS_FC2.from_hf(downs, CTX).view(E, F, H)
    assert torch.equal(w2_EFH[1], downs[1].t())
    padded = T.PAD_VOCAB.from_hf(_hf_inputs("pad_vocab", g), CTX)
    assert tuple(padded.shape) == (16, H) and torch.count_nonzero(padded[10:]).item() == 0


# ------------------------------------------------------------------------------------------------
# Logit parity with transformers (fp32, CPU)
# ------------------------------------------------------------------------------------------------


def test_verify_reports_fp32_parity(tiny):
    # Measured 4.5e-7 (fp32 summation order differs between the two attention/MoE kernels).
    diff = verify(tiny.hf, tiny.mcore)
    assert 0.0 <= diff <= 1e-4


def test_packed_documents_match_each_document_alone(tiny):
    docs = _docs(VOCAB)
    model = load_model_from_checkpoint(tiny.mcore).eval()
    ours = packed_logits(model, docs, VOCAB)
    assert [tuple(t.shape) for t in ours] == [(n, VOCAB) for n in DOC_LENGTHS]
    refs = [_hf_logits(tiny.hf_model, doc) for doc in docs]
    worst = max((ref - mine).abs().max().item() for ref, mine in zip(refs, ours))
    assert worst <= 1e-4  # measured ≈ 5e-7
    # Non-trivial: run as one undivided sequence, documents 2 and 3 see their predecessors and
    # their logits move far beyond the tolerance, so the packed match above proves the boundary.
    joined = _hf_logits(tiny.hf_model, [t for d in docs for t in d])
    second = joined[DOC_LENGTHS[0] : DOC_LENGTHS[0] + DOC_LENGTHS[1]]
    assert (second - refs[1]).abs().max().item() > 1e-2


# ------------------------------------------------------------------------------------------------
# A dense (mlp_only_layers) layer, and generation_config.json created when the source has none
# ------------------------------------------------------------------------------------------------


def test_dense_layer_converts_and_round_trips(tmp_path):
    cfg = qwen3_moe.tiny_hf_config(vocab_size=VOCAB, mlp_only_layers=[0])
    hf_model = _new_hf_model(cfg, seed=5, save_to=tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink()
    original = _read_dir(tmp_path / "hf")
    assert original["model.layers.0.mlp.gate_proj.weight"].shape == (256, 128)
    convert(tmp_path / "hf", tmp_path / "mcore")
    entries = {e.mcore: e for e in mapping.expand(FAMILY, cfg)}
    assert entries["decoder.layers.0.mlp.linear_fc1.weight"].transform is T.GATE_UP_FUSE
    assert "decoder.layers.0.mlp.router.weight" not in entries
    assert "decoder.layers.1.mlp.router.weight" in entries
    export(tmp_path / "mcore", tmp_path / "out", dtype="fp32")
    exported = _read_dir(tmp_path / "out")
    assert set(exported) == set(original) and len(original) == 69 - 25 + 3  # 24 experts+router → 3
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["_from_model_config"] is True  # created from config.json, not copied
    docs = _docs(VOCAB, (12, 20))
    ours = packed_logits(load_model_from_checkpoint(tmp_path / "mcore").eval(), docs, VOCAB)
    worst = max((_hf_logits(hf_model, d) - o).abs().max().item() for d, o in zip(docs, ours))
    assert worst <= 1e-4


# ------------------------------------------------------------------------------------------------
# Unusable input: each error names the file / tensor / field
# ------------------------------------------------------------------------------------------------


def _write_checkpoint(path: Path, tensors: dict, config: dict, shards: int = 1) -> Path:
    """An HF directory with `tensors` split over `shards` files plus an index when sharded."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _config(tiny, **changes) -> dict:
    return dict(json.loads((tiny.hf / "config.json").read_text()), **changes)


def _convert_fails(tmp_path, hf_dir, error, *fragments):
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        convert(hf_dir, out)
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert missing == [], f"{missing} not in: {message}"
    assert not out.exists() and not out.with_name("out.tmp").exists()  # nothing half-written
    return message


def test_directory_without_config_json(tmp_path):
    bad = tmp_path / "hf"
    bad.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(bad / "model.safetensors"))
    _convert_fails(tmp_path, bad, CheckpointError, str(bad), "no config.json")


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v99"])  # known / unknown to transformers
def test_unsupported_model_type_lists_supported(tmp_path, tiny, model_type):
    bad = _write_checkpoint(tmp_path / "hf", tiny.tensors, _config(tiny, model_type=model_type))
    msg = _convert_fails(
        tmp_path,
        bad,
        UnsupportedConfigError,
        str(bad / "config.json"),
        repr(model_type),
        "supported: " + ", ".join(registry.supported_model_types()),
    )
    assert "qwen3_moe" in msg and "deepseek_v3" in msg and "mixtral" in msg
    assert "not supported" in msg


def test_index_naming_a_missing_shard(tmp_path, tiny):
    bad = _write_checkpoint(tmp_path / "hf", tiny.tensors, _config(tiny), shards=2)
    (bad / "model-00002-of-00002.safetensors").unlink()
    _convert_fails(
        tmp_path, bad, CheckpointError, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"
    )


def test_truncated_safetensors(tmp_path, tiny):
    bad = _write_checkpoint(tmp_path / "hf", tiny.tensors, _config(tiny))
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    _convert_fails(tmp_path, bad, CheckpointError, str(bad / "model.safetensors"), "truncated")


def test_missing_expert_tensor_is_listed(tmp_path, tiny):
    lost = "model.layers.1.mlp.experts.5.up_proj.weight"
    tensors = {n: t for n, t in tiny.tensors.items() if n != lost}
    bad = _write_checkpoint(tmp_path / "hf", tensors, _config(tiny))
    _convert_fails(tmp_path, bad, MappingError, "lacks 1 tensor", lost)


def test_unknown_extra_tensor_is_listed(tmp_path, tiny):
    extra = "model.layers.0.mlp.shared_expert.up_proj.weight"
    bad = _write_checkpoint(tmp_path / "hf", dict(tiny.tensors, **{extra: torch.zeros(4, 4)}), _config(tiny))
    _convert_fails(tmp_path, bad, MappingError, extra, "neither loads nor lists as dropped")


def test_untied_embeddings_without_lm_head(tmp_path, tiny):
    tensors = {n: t for n, t in tiny.tensors.items() if n != "lm_head.weight"}
    bad = _write_checkpoint(tmp_path / "hf", tensors, _config(tiny, tie_word_embeddings=False))
    _convert_fails(tmp_path, bad, MappingError, "lm_head.weight", "tie_word_embeddings=false")


def test_sliding_window_is_refused(tmp_path, tiny):
    bad = _write_checkpoint(tmp_path / "hf", tiny.tensors, _config(tiny, use_sliding_window=True, sliding_window=64))
    _convert_fails(tmp_path, bad, UnsupportedConfigError, "config.json", "use_sliding_window=true")


def test_mixed_dtypes_across_shards(tmp_path, tiny):
    tensors = dict(tiny.tensors)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    bad = _write_checkpoint(tmp_path / "hf", tensors, _config(tiny), shards=2)
    norm_file = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    _convert_fails(tmp_path, bad, CheckpointError, str(bad), "mix floating dtypes", "BF16", "F32", norm_file)


# ------------------------------------------------------------------------------------------------
# The command-line tools
# ------------------------------------------------------------------------------------------------

_NOT_INHERITED = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _start_tool(script: str, *args: str, cwd: Path) -> subprocess.Popen:
    """Run from an unrelated cwd without PYTHONPATH: the script must find the repo itself.

    The fixture's in-process world of one put RANK/MASTER_PORT/... into os.environ; a child that
    inherited them would rendezvous on the parent's port, so they are removed like torchrun's.
    """
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    return subprocess.Popen(
        [sys.executable, str(REPO / "tools" / script), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> SimpleNamespace:
    stdout, stderr = proc.communicate(timeout=300)
    return SimpleNamespace(returncode=proc.returncode, stdout=stdout, stderr=stderr)


def _run_tool(script: str, *args: str, cwd: Path) -> SimpleNamespace:
    return _finish(_start_tool(script, *args, cwd=cwd))


def test_cli_convert_verify_and_export(tmp_path, tiny):
    # Both tools at once (export reads the fixture's checkpoint): each spends ~10 s importing.
    exporting = _start_tool(
        "export_mcore_to_hf.py",
        "--mcore-path",
        str(tiny.mcore),
        "--output",
        str(tmp_path / "out"),
        "--dtype",
        "bf16",
        "--max-shard-size",
        "1MB",
        cwd=tmp_path,
    )
    converting = _start_tool(
        "convert_hf_to_mcore.py",
        "--hf-path",
        str(tiny.hf),
        "--output",
        str(tmp_path / "mcore"),
        "--verify",
        "--tolerance",
        "1e-4",
        cwd=tmp_path,
    )
    proc = _finish(converting)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(re.search(r"max abs logit difference: (\S+) \(tolerance 0.0001\)", proc.stdout)[1])
    assert diff <= 1e-4
    assert re.search(r"converted 69 HF tensors \(qwen3_moe, fp32\) in [\d.]+s -> .*mcore", proc.stdout)
    assert (tmp_path / "mcore" / "moe_sft_meta.json").is_file()
    proc = _finish(exporting)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported 69 tensors (bf16, 2 shard(s), 1.9 MB)" in proc.stdout
    exported = _read_dir(tmp_path / "out")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert torch.equal(exported["lm_head.weight"], tiny.tensors["lm_head.weight"].to(torch.bfloat16))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_bad_path_is_one_line_exit_2(tmp_path):
    proc = _run_tool(
        "convert_hf_to_mcore.py", "--hf-path", str(tmp_path / "nope"), "--output", str(tmp_path / "mcore"), cwd=tmp_path
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"error: {tmp_path / 'nope'}: HF checkpoint directory does not exist\n"
    proc = _run_tool(
        "export_mcore_to_hf.py", "--mcore-path", str(tmp_path / "nope"), "--output", str(tmp_path / "hf"), cwd=tmp_path
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == f"error: {tmp_path / 'nope'}: moe-sft checkpoint directory does not exist\n"


def _load_tool(script: str):
    return load_tool(script)


def test_cli_exit_codes_in_process(tmp_path, tiny, capsys):
    convert_tool, export_tool = _load_tool("convert_hf_to_mcore.py"), _load_tool("export_mcore_to_hf.py")
    # A tolerance below the measured 4.5e-7 must fail the verification with exit status 1.
    status = convert_tool.main(
        ["--hf-path", str(tiny.hf), "--output", str(tmp_path / "m"), "--verify", "--tolerance", "1e-12"]
    )
    captured = capsys.readouterr()
    assert status == 1 and "tolerance 1e-12" in captured.out
    assert "error:" in captured.err and "> 1e-12" in captured.err
    # Library errors (past the CLI's own path check) become one `error:` line and exit status 2.
    status = export_tool.main(["--mcore-path", str(tiny.hf), "--output", str(tmp_path / "o")])
    assert status == 2
    assert f"error: {tiny.hf}: no moe_sft_meta.json" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    status = convert_tool.main(["--hf-path", str(tmp_path / "empty"), "--output", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"error: {tmp_path / 'empty'}: no config.json")
    assert err.count("\n") == 1
    assert (export_tool.parse_size("5GB"), export_tool.parse_size("2MiB")) == (5 * 10**9, 2 * 2**20)
    assert export_tool.parse_size("1000") == 1000


def test_export_replaces_a_previous_output(tmp_path, tiny):
    out = tmp_path / "out"
    shutil.copytree(tiny.exported, out)
    (out / "stale.safetensors").write_bytes(b"x")
    export(tiny.mcore, out, dtype="fp32", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_deepseek_v3_export_keeps_the_router_fields_engines_read(tmp_path):
    """vLLM gives DeepSeek-V3's router its e_score_correction_bias from `topk_method: noaux_tc` /
    `scoring_func: sigmoid`, fields of the release's config.json that transformers' class does
    not declare: the tiny model writes them as the release does and the export keeps them."""
    from moe_sft.quickstart_model import create_tiny_hf

    create_tiny_hf(tmp_path / "hf", Path("recipes/demo/tokenizer"), family="deepseek_v3")
    convert(tmp_path / "hf", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["topk_method"], out["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert out == dict(source, dtype="bfloat16")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.py")) == [
        "configuration_deepseek.py",
        "modeling_deepseek.py",
    ]


def test_remote_code_files_are_the_local_modules_auto_map_names(tmp_path):
    """config.json's and tokenizer_config.json's `auto_map` (a tokenizer's is a [slow, fast] list)
    name the modules a checkpoint carries; another repository's (`org/repo--module.Class`) and a
    module the directory lacks are not files to copy."""
    from moe_sft.conversion import mcore_io

    auto_map = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        "AutoModel": "other/repo--modeling_other.Model",
    }
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": auto_map}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}})
    )
    for module in ("configuration_deepseek.py", "tokenization_kimi.py", "modeling_other.py", "unrelated.py"):
        (tmp_path / module).write_text("")
    assert mcore_io.remote_code_files(tmp_path) == ["configuration_deepseek.py", "tokenization_kimi.py"]
    copied = mcore_io.copy_hf_side_files(tmp_path, tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(copied)
    assert "tokenization_kimi.py" in copied and "unrelated.py" not in copied
