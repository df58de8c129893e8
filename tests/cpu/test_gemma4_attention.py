"""moe_sft/layers/gemma4_attention.py against transformers' own Gemma4TextAttention followed by the
decoder layer's post_attention_layernorm, weights copied through the family's mapping table
(moe_sft/models/gemma4.py), fp32: packed THD documents (some longer than the sliding window, one
of one token) against transformers on each document alone, outputs and every gradient (input and
weights, the HF weight gradients mapped by the same table); sliding, full, k-eq-v and not, the
tiny config and randomized ones; the [s, b] layout; the per-layer TP refusal.
"""

from __future__ import annotations

import random

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextAttention, Gemma4TextRotaryEmbedding

from moe_sft.conversion import mapping
from moe_sft.layers.gemma4_attention import gemma4_attention_spec
from moe_sft.models import gemma4
from moe_sft.models.builder import ModelOptions, build_transformer_config
from moe_sft.models.forward import packed_seq_params
from moe_sft.runtime import cpu_compat

FAMILY = gemma4.FAMILY
LENGTHS = (1, 7, 23, 40)  # the tiny config's window is 16: two documents run past it
TOL = dict(rtol=1e-4, atol=1e-4)


def _world(tp: int):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.cpu.test_plan import _reset_world

    _reset_world()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)


@pytest.fixture
def one_rank_world():
    """A one-rank fake process group (megatron's linears read the TP group at construction)."""
    from tests.cpu.test_plan import _reset_world

    _world(1)
    yield
    _reset_world()


class _Reference(torch.nn.Module):
    """transformers' attention of layer `index` with its layer's post_attention_layernorm."""

    def __init__(self, cfg, index: int):
        super().__init__()
        self.cfg, self.index, self.kind = cfg, index, cfg.layer_types[index]
        self.self_attn = Gemma4TextAttention(cfg, index)
        self.post_attention_layernorm = Gemma4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Gemma4TextRotaryEmbedding(cfg)

    def forward(self, x):  # [1, n, hidden], one document
        positions = torch.arange(x.shape[1])[None]
        make_mask = create_sliding_window_causal_mask if self.kind == gemma4.SLIDING else create_causal_mask
        mask = make_mask(
            config=self.cfg,
            inputs_embeds=x,
            attention_mask=None,
            cache=None,
            position_ids=positions,
            allow_is_causal_skip=False,
        )
        out, _ = self.self_attn(x, self.rotary(x, positions, self.kind), mask, shared_kv_states={})
        return self.post_attention_layernorm(out)

    def hf_state(self) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{self.index}."
        state = {prefix + "self_attn." + n: p for n, p in self.self_attn.named_parameters()}
        state[prefix + "post_attention_layernorm.weight"] = self.post_attention_layernorm.weight
        return state


def _pair(cfg, index: int, seed: int = 0):
    """(transformers' reference, ours) for decoder layer `index`, random weights shared by the table."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = _Reference(cfg, index)
    with torch.no_grad():  # transformers initialises the norms to 1: randomise everything
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    config = build_transformer_config(FAMILY, cfg, ModelOptions(precision="fp32", backend="torch", device="cpu"))
    ours = build_module(gemma4_attention_spec(), config=config, layer_number=index + 1)
    mapped = _mapped(cfg, index, {n: p.detach() for n, p in ref.hf_state().items()})
    ours.load_state_dict(mapped, strict=True)
    return ref, ours


def _mapped(cfg, index: int, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The table's megatron tensors of layer `index`'s attention from HF tensors, prefix removed."""
    prefix = f"decoder.layers.{index}.self_attention."
    ctx = mapping.transform_context(FAMILY, cfg)
    out = {}
    for entry in mapping.expand(FAMILY, cfg):
        if entry.mcore.startswith(prefix):
            out[entry.mcore[len(prefix) :]] = entry.transform.from_hf([hf[n] for n in entry.hf], ctx)
    return out


def _compare_packed(cfg, index: int, lengths=LENGTHS, seed: int = 0) -> float:
    """Ours on the packed documents against transformers per document: outputs, the input's and
    every weight's gradient. Returns the largest output difference."""
    ref, ours = _pair(cfg, index, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(lengths), 1, cfg.hidden_size, generator=g)
    weights = torch.randn(x.shape, generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    x_ours = x.clone().requires_grad_()
    out, bias = ours(x_ours, None, packed_seq_params=packed_seq_params(cu, max(lengths)))
    assert bias is None
    (out * weights).sum().backward()
    x_ref = x.clone().requires_grad_()
    with cpu_compat.suspended():
        docs = [ref(doc.transpose(0, 1)).transpose(0, 1) for doc in torch.split(x_ref, lengths)]
        expected = torch.cat(docs)
        (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)
    hf_grads = {n: p.grad for n, p in ref.hf_state().items()}
    for name, grad in _mapped(cfg, index, hf_grads).items():
        torch.testing.assert_close(dict(ours.named_parameters())[name].grad, grad, **TOL, msg=name)
    return (out - expected).abs().max().item()


def test_tiny_sliding_and_full_k_eq_v_layers_match_transformers_per_document(one_rank_world):
    cfg = FAMILY.tiny_hf_config()
    assert cfg.layer_types == [gemma4.SLIDING, gemma4.FULL] and cfg.attention_k_eq_v
    for index in (0, 1):
        _compare_packed(cfg, index)


def test_full_layer_with_its_own_values_matches_transformers(one_rank_world):
    """attention_k_eq_v=False: the full layer keeps v_proj, global_head_dim and the sliding kv heads."""
    cfg = FAMILY.tiny_hf_config(attention_k_eq_v=False)
    _compare_packed(cfg, 1)


@pytest.mark.parametrize("seed", range(4))
def test_sampled_configs_match_transformers(one_rank_world, seed):
    """Random legal configs (layer types, windows down to 4, k-eq-v, head dims, kv heads, rope
    types, partial factors and thetas): every layer."""
    cfg = FAMILY.sample_hf_config(random.Random(seed), vocab_size=64)
    for index in range(cfg.num_hidden_layers):
        _compare_packed(cfg, index, lengths=(5, 1, 37), seed=seed)


def test_positions_restart_at_every_document(one_rank_world):
    """The failing control for the per-document positions: the same tokens as one document give
    other outputs for the second document (its RoPE angles and its keys differ)."""
    cfg = FAMILY.tiny_hf_config()
    _, ours = _pair(cfg, 1)
    x = torch.randn(30, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    two = torch.tensor([0, 10, 30], dtype=torch.int32)
    one = torch.tensor([0, 30], dtype=torch.int32)
    with torch.no_grad():
        packed, _ = ours(x, None, packed_seq_params=packed_seq_params(two, 20))
        alone, _ = ours(x[10:], None, packed_seq_params=packed_seq_params(torch.tensor([0, 20]), 20))
        whole, _ = ours(x, None, packed_seq_params=packed_seq_params(one, 30))
    torch.testing.assert_close(packed[10:], alone, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(packed[10:], whole[10:], atol=1e-3)


def test_sbhd_batch_rows_are_documents(one_rank_world):
    """Unpacked [s, b, h] input: each batch row is one document, as transformers' batch."""
    cfg = FAMILY.tiny_hf_config()
    for index in (0, 1):
        ref, ours = _pair(cfg, index)
        x = torch.randn(23, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            out, _ = ours(x, None)
            with cpu_compat.suspended():
                expected = torch.stack([ref(x[:, b][None])[0] for b in range(2)], dim=1)
        torch.testing.assert_close(out, expected, **TOL)


def test_tensor_parallel_splits_groups_and_refuses_indivisible_kv_heads():
    """TP=2 (a fake two-rank group): the sliding layer's two kv heads split one per rank; the full
    layer's one global kv head cannot, and the error names the field."""
    from tests.cpu.test_plan import _reset_world

    cfg = FAMILY.tiny_hf_config()
    _world(2)
    try:
        opts = ModelOptions(precision="fp32", backend="torch", device="cpu")
        opts.transformer["tensor_model_parallel_size"] = 2
        config = build_transformer_config(FAMILY, cfg, opts)
        sliding = build_module(gemma4_attention_spec(), config=config, layer_number=1)
        heads, (head_dim, groups) = cfg.num_attention_heads, gemma4.layer_attention(cfg, 0)
        assert sliding.linear_qkv.weight.shape == ((heads + 2 * groups) * head_dim // 2, cfg.hidden_size)
        assert sliding.linear_proj.weight.shape == (cfg.hidden_size, heads * head_dim // 2)
        with pytest.raises(ValueError, match="num_global_key_value_heads"):
            build_module(gemma4_attention_spec(), config=config, layer_number=2)
    finally:
        _reset_world()


def test_drops_into_megatrons_transformer_layer_as_self_attention(one_rank_world):
    """megatron's TransformerLayer with this spec as `self_attention` (no MLP) computes the HF
    layer's attention half, x + post_attention_layernorm(attn(input_layernorm(x))), on packed
    documents: the keyword interface and the (output, None) the layer's bias-dropout-add takes."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from moe_sft.layers.norm import Gemma4RMSNorm

    cfg = FAMILY.tiny_hf_config()
    ref, ours = _pair(cfg, 1)
    spec = TransformerLayerSubmodules(
        input_layernorm=Gemma4RMSNorm, self_attention=gemma4_attention_spec(), self_attn_bda=get_bias_dropout_add
    )
    layer = TransformerLayer(ours.config, spec, layer_number=2)
    input_norm = Gemma4RMSNorm(ours.config, cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        input_norm.weight.copy_(1 + 0.3 * torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(7)))
    layer.input_layernorm.load_state_dict(input_norm.state_dict())
    layer.self_attention.load_state_dict(ours.state_dict())
    x = torch.randn(sum(LENGTHS), 1, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out, _ = layer(x, attention_mask=None, packed_seq_params=packed_seq_params(cu, max(LENGTHS)))
        with cpu_compat.suspended():
            normed = input_norm(x)
            docs = [ref(doc.transpose(0, 1)).transpose(0, 1) for doc in torch.split(normed, LENGTHS)]
    torch.testing.assert_close(out, x + torch.cat(docs), **TOL)


def test_dist_checkpoint_keys_are_per_layer_with_each_layers_shape(one_rank_world):
    """Sliding and full layers' tensors differ in shape: the family's config makes megatron's
    TransformerBlock key them per layer (stacked keys would need one shape for all layers)."""
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    cfg = FAMILY.tiny_hf_config()
    config = build_transformer_config(FAMILY, cfg, ModelOptions(precision="fp32", backend="torch", device="cpu"))
    layer = ModuleSpec(
        module=TransformerLayer, submodules=TransformerLayerSubmodules(self_attention=gemma4_attention_spec())
    )
    block = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[layer, layer]), post_layer_norm=False)
    sharded = block.sharded_state_dict(prefix="decoder.")
    for index in (0, 1):
        head_dim, groups = gemma4.layer_attention(cfg, index)
        per_group = cfg.num_attention_heads // groups + (1 if gemma4.k_eq_v(cfg, index) else 2)
        qkv = sharded[f"decoder.layers.{index}.self_attention.linear_qkv.weight"]
        assert qkv.key == f"decoder.layers.{index}.self_attention.linear_qkv.weight"
        assert qkv.global_shape == (groups * per_group * head_dim, cfg.hidden_size)
        assert sharded[f"decoder.layers.{index}.self_attention.post_layernorm.weight"].global_shape == (
            cfg.hidden_size,
        )


def test_built_on_the_meta_device_keeps_its_rope(one_rank_world):
    """Layer-wise verify (conversion/verify.py) builds the model on the meta device, gives its
    parameters and buffers empty storage and loads the checkpoint's tensors: the RoPE frequencies,
    which are in no checkpoint, must survive that."""
    from moe_sft.conversion.verify import _materialise

    cfg = FAMILY.tiny_hf_config()
    _, ours = _pair(cfg, 1)
    with torch.device("meta"):
        meta = build_module(gemma4_attention_spec(), config=ours.config, layer_number=2)
    _materialise(meta)
    meta.load_state_dict(ours.state_dict())
    x = torch.randn(sum(LENGTHS), 1, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    params = packed_seq_params(torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32), max(LENGTHS))
    with torch.no_grad():
        torch.testing.assert_close(
            meta(x, None, packed_seq_params=params)[0], ours(x, None, packed_seq_params=params)[0]
        )
