"""gpt-oss's MXFP4 expert tensors are dequantised while streaming, bit-equal to transformers'
`convert_moe_packed_tensors` and in the layout `GptOssExperts` holds; the reader presents
`X_blocks` + `X_scales` as the one parameter `X`, and a missing part names the file and tensor.

The MXFP4 checkpoint is made in the test: a tiny random `GptOssForCausalLM` saved in bf16, whose
expert tensors are then replaced by blocks/scales in the official naming."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moe_sft.conversion import hf_source, mxfp4
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.conversion.streaming_reader import StreamingHFReader
from moe_sft.runtime import cpu_compat
from tests.safe_open_reader import SafeOpenHFReader

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _random_mxfp4(shape, seed, scale_range=(0, 256)):
    """Random blocks [*shape, 16] and scales `shape` (every fp4 code, the given exponent range)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(*scale_range, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit patterns: the full e8m0 range gives inf/NaN, which torch.equal calls unequal."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    ("shape", "seed", "dtype"),
    [((4, 128, 2), 0, torch.bfloat16), ((3, 40, 5), 1, torch.bfloat16), ((2, 64, 3), 2, torch.float32)],
)
def test_dequantize_is_bit_equal_to_transformers(shape, seed, dtype):
    blocks, scales = _random_mxfp4(shape, seed)
    ours = mxfp4.dequantize(blocks, scales, dtype=dtype)
    # convert_moe_packed_tensors already ends with the transpose to GptOssExperts' layout, and
    # transformers' Mxfp4Dequantize loads its result into the parameter as is.
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (shape[0], shape[2] * 32, shape[1]) == theirs.shape
    assert torch.equal(_bits(ours), _bits(theirs))


def test_dequantize_in_chunks_matches_one_pass(monkeypatch):
    blocks, scales = _random_mxfp4((5, 32, 2), 3, scale_range=(100, 150))
    whole = mxfp4.dequantize(blocks, scales)
    monkeypatch.setattr(mxfp4, "_CHUNK_ELEMENTS", 2 * 32 * 64)  # two experts per chunk, one left over
    assert torch.equal(mxfp4.dequantize(blocks, scales), whole)


def test_dequantize_rejects_mismatched_scales():
    blocks, scales = _random_mxfp4((2, 8, 2), 4)
    with pytest.raises(ValueError, match="not MXFP4"):
        mxfp4.dequantize(blocks, scales[:, :, :1])


def test_round_trip_is_exact_on_representable_values():
    blocks, scales = _random_mxfp4((3, 16, 4), 5, scale_range=(110, 140))
    weight = mxfp4.dequantize(blocks, scales, dtype=torch.float32)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(weight), dtype=torch.float32), weight)


def test_round_trip_is_within_fp4_rounding():
    torch.manual_seed(0)
    weight = torch.randn(3, 96, 40) * torch.logspace(-3, 2, 40)  # columns (rows of blocks) of all scales
    back = mxfp4.dequantize(*mxfp4.quantize(weight), dtype=torch.float32)
    # Nearest e2m1 value: off by at most a quarter of the value (steps 0.5 / 1 / 2 within [1, 2) /
    # [2, 4) / [4, 6]), or by 2**e / 4 near zero, where 2**e < block max / 3 (smallest exponent).
    block_max = weight.abs().unflatten(1, (3, 32)).amax(2, keepdim=True).expand(-1, -1, 32, -1).flatten(1, 2)
    bound = torch.maximum(weight.abs() / 4, block_max / 12) * (1 + 1e-6)
    assert ((back - weight).abs() <= bound).all()
    assert not torch.equal(back, weight)  # the bound is tested on values that do round


def _tiny_config() -> GptOssConfig:
    return GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """(dir, bf16 tensors, stored MXFP4 tensors); experts quantised, everything else as saved."""
    tmp = tmp_path_factory.mktemp("mxfp4")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        GptOssForCausalLM(_tiny_config()).to(torch.bfloat16).save_pretrained(str(tmp / "bf16"))
    original = load_file(str(tmp / "bf16" / "model.safetensors"))
    stored = {}
    for name, tensor in original.items():
        if name.endswith(EXPERTS):
            stored[mxfp4.blocks_name(name)], stored[mxfp4.scales_name(name)] = mxfp4.quantize(tensor)
        else:
            stored[name] = tensor
    (tmp / "mxfp4").mkdir()
    save_file(stored, str(tmp / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}  # as gpt-oss's config.json
    (tmp / "mxfp4" / "config.json").write_text(json.dumps(config))
    return tmp / "mxfp4", original, stored


def _expected(name, stored):
    return mxfp4.dequantize(stored[mxfp4.blocks_name(name)], stored[mxfp4.scales_name(name)])


def test_streaming_reader_presents_dequantised_experts(mxfp4_checkpoint):
    path, original, stored = mxfp4_checkpoint
    reader = StreamingHFReader(path)
    assert reader.names() == set(original)
    assert any(n.endswith(mxfp4.BLOCKS_SUFFIX) for n in stored)
    for name, tensor in original.items():
        got = reader.get(name)
        assert got.shape == tensor.shape and got.dtype == torch.bfloat16, name
        if name.endswith(EXPERTS):
            assert reader.is_mxfp4(name) and not reader.is_fp8(name)
            assert reader.row_shape(name) is None  # read whole, never by rows
            assert torch.equal(got, mxfp4.dequantize(*mxfp4.quantize(tensor))), name
        else:
            assert not reader.is_mxfp4(name)
            assert torch.equal(got, tensor), name
        assert reader.file_of(name) == path / "model.safetensors"
    assert reader.empty_names() == set()
    # uint8 blocks/scales are no second float dtype beside the bf16 tensors
    assert hf_source.check_dtypes(reader) == "bf16"
    assert reader.dtypes() == {"model.safetensors": {"BF16", "MXFP4"}}
    reader.close()


def test_safe_open_reader_agrees(mxfp4_checkpoint):
    path, original, stored = mxfp4_checkpoint
    reader = SafeOpenHFReader(path)
    name = "model.layers.1.mlp.experts.down_proj"
    assert reader.names() == set(original)
    assert torch.equal(reader.get(name), _expected(name, stored))


def test_transformers_loads_the_same_values(mxfp4_checkpoint):
    """transformers' own MXFP4 loader (dequantize=True) fills GptOssExperts with what we read."""
    path, original, stored = mxfp4_checkpoint
    with cpu_compat.suspended():
        model = GptOssForCausalLM.from_pretrained(
            str(path), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
        )
    params = model.state_dict()
    reader = StreamingHFReader(path)
    for name in original:
        assert torch.equal(params[name], reader.get(name)), name
    reader.close()


@pytest.mark.parametrize("missing", [mxfp4.SCALES_SUFFIX, mxfp4.BLOCKS_SUFFIX])
def test_missing_part_names_file_and_tensor(mxfp4_checkpoint, tmp_path, missing):
    path, _, stored = mxfp4_checkpoint
    victim = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({k: v for k, v in stored.items() if k != victim + missing}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    reader = StreamingHFReader(tmp_path)
    assert victim in reader.names()  # still presented: the error comes when it is read
    with pytest.raises(CheckpointError) as err:
        reader.get(victim)
    present = mxfp4.BLOCKS_SUFFIX if missing == mxfp4.SCALES_SUFFIX else mxfp4.SCALES_SUFFIX
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message
    assert repr(victim + missing) in message and repr(victim + present) in message
    assert "re-download" in message
    reader.close()


def test_an_mxfp4_checkpoint_converts_to_the_model_transformers_dequantises_and_exports_bf16(
    mxfp4_checkpoint, tmp_path
):
    """The released format end to end: converting the MXFP4 checkpoint gives a model whose fp32
    logits (packed documents) equal transformers' on its own dequantised load, and the export
    writes the experts in bf16 under their parameter names (blocks and scales gone)."""
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.export import export, load_model_from_checkpoint
    from moe_sft.models.forward import packed_logits

    path, original, stored = mxfp4_checkpoint
    convert(path, tmp_path / "mcore")
    with cpu_compat.suspended():
        # .float(): transformers < 5.24 keeps the dequantised experts in bf16 whatever `dtype` says
        # (exact: e2m1 x e8m0 values are bf16 values), which would make this a bf16 reference
        hf = (
            GptOssForCausalLM.from_pretrained(
                str(path), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
            )
            .float()
            .eval()
        )
    g = torch.Generator().manual_seed(3)
    vocab = hf.config.vocab_size
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (19, 40, 7)]
    with cpu_compat.suspended(), torch.no_grad():
        refs = [hf(torch.tensor([d])).logits[0].float() for d in docs]
    ours = packed_logits(load_model_from_checkpoint(tmp_path / "mcore").eval(), docs, vocab)
    worst = max((r - o).abs().max().item() for r, o in zip(refs, ours))
    assert worst <= 1e-4, worst
    export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    out = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    for f in sorted((tmp_path / "out").glob("*.safetensors"))[1:]:
        out.update(load_file(str(f)))
    assert set(out) == set(original)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], _expected(name, stored))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
