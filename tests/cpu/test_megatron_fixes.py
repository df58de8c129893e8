"""moe_sft/runtime/megatron_fixes.py: each test first runs megatron-core's own (unfixed) code on the
buggy case and asserts the bug, then asserts the fixed behaviour. When a megatron-core release fixes
a bug, its first half fails: drop the fix (or narrow its version range in FIXES)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from moe_sft.runtime import cpu_compat, megatron_fixes
from moe_sft.runtime.patches import original

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the CPU emulation runs megatron here)")
needs_no_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="the bug exists only without Transformer Engine"
)


@pytest.fixture(scope="module", autouse=True)
def fixed():
    megatron_fixes.apply_megatron_fixes()
    cpu_compat.apply_cpu_compat()


def test_every_fix_is_applied_on_the_tested_version_and_logged_as_skipped_on_another():
    from megatron.core import package_info

    assert package_info.__version__.startswith(megatron_fixes.MCORE_0_16)
    applied = megatron_fixes._applied["done"]
    megatron_fixes._applied["done"] = False
    calls = []
    saved = megatron_fixes.FIXES
    try:
        megatron_fixes.FIXES = (megatron_fixes.Fix(lambda: calls.append(1) or "x", ("0.16.",)),)
        lines = megatron_fixes.apply_megatron_fixes(version="0.99.0")
    finally:
        megatron_fixes.FIXES, megatron_fixes._applied["done"] = saved, applied
    assert not calls and len(lines) == 1 and "not applied" in lines[0] and "0.99.0" in lines[0]


@needs_no_te
def test_router_gemm_name_without_te():
    from megatron.core.transformer.moe import moe_utils

    x, w = torch.randn(5, 8), torch.randn(3, 8)
    fixed_value = moe_utils.__dict__.pop("te_general_gemm")
    try:  # megatron: the name was never bound
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(x, w, None, torch.float32)
    finally:
        moe_utils.te_general_gemm = fixed_value
    assert moe_utils.te_general_gemm is None
    torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.t())


@needs_no_te
def test_mla_have_te_says_te_is_absent():
    from megatron.core.transformer import multi_latent_attention as mla

    assert original(mla, "HAVE_TE") is True  # megatron: TE "available" (its mock classes imported)
    with pytest.raises(TypeError):  # ... so MLA's constructor runs isinstance(linear_proj, <mock>)
        isinstance(torch.nn.Linear(2, 2), mla.TELinear)
    assert mla.HAVE_TE is False


def _dist_opt_with_adam_state(step: float):
    main = torch.zeros(3)
    state = {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3), "step": torch.tensor(step)}
    inner = SimpleNamespace(param_groups=[{"params": [main]}], state={main: state})
    model_param = torch.zeros(3)
    self = SimpleNamespace(
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=inner,
        model_param_group_index_map={model_param: (0, 0)},
    )
    return self, model_param, main, state


def test_fully_reshardable_load_without_a_step_tensor():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    loaded = {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.full((3,), 3.0)}
    self, model_param, _, _ = _dist_opt_with_adam_state(7.0)
    with pytest.raises(KeyError, match="step"):  # megatron: every state key is read from the loaded tensors
        original(DistributedOptimizer, "_set_main_param_and_optimizer_states")(self, model_param, loaded)
    self, model_param, main, state = _dist_opt_with_adam_state(7.0)
    DistributedOptimizer._set_main_param_and_optimizer_states(self, model_param, loaded)
    assert main.tolist() == [1.0] * 3 and state["exp_avg_sq"].tolist() == [3.0] * 3
    assert float(state["step"]) == 7.0


def test_loaded_step_tensors_are_not_shared_between_parameters():
    """megatron's load_state_dict leaves one 'step' tensor in every parameter's state (measured end to
    end by tests/dist/test_quickstart_e2e.py's resume equivalence); torch's Adam then counts a step
    once per parameter. The fix gives each parameter its own tensor after megatron's load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]

    def steps_after_one_update(unshare: bool) -> list[float]:
        adam = torch.optim.Adam(params, lr=0.1)
        shared = torch.tensor(4.0)  # what megatron's load leaves: one tensor for every parameter
        for p in params:
            p.grad = torch.ones(2)
            adam.state[p] = {"step": shared, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
        if unshare:
            megatron_fixes.unshare_step_tensors(adam)
        adam.step()
        return [float(adam.state[p]["step"]) for p in params]

    assert steps_after_one_update(unshare=False) == [7.0] * 3  # one update counted three times
    assert steps_after_one_update(unshare=True) == [5.0] * 3
    assert DistributedOptimizer.load_state_dict.__wrapped__ is original(DistributedOptimizer, "load_state_dict")


def _hybrid_optimizer_case():
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import Range

    model_param = torch.arange(6, dtype=torch.bfloat16)  # the weights just loaded
    main = torch.zeros(4)  # this rank's fp32 shard: elements 2..5, still the pre-load values
    cpu_copy = torch.zeros(4)  # what the hybrid optimizer steps on the CPU
    hdo = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    hdo.gpu_params_map_cpu_copy, hdo.param_to_fp32_param = {main: cpu_copy}, {}
    hdo.param_update_in_fp32, hdo.state = True, {main: {"master_param": cpu_copy}}
    dist_opt = SimpleNamespace(
        optimizer=hdo,
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        ddp_config=SimpleNamespace(use_megatron_fsdp=False),
        is_stub_optimizer=False,
        model_float16_groups=[[model_param]],
        shard_fp32_from_float16_groups=[[main]],
        model_fp32_groups=[],
        shard_fp32_groups=[],
        _get_model_param_range_map=lambda p: {"param": Range(2, 6)},
    )
    return dist_opt, hdo, main, cpu_copy


def test_hybrid_optimizer_main_params_and_cpu_copies_follow_loaded_weights():
    """Optimizer CPU offload: reload_model_params must refresh the fp32 main shard *and* the CPU copy
    the hybrid optimizer steps; a resume that loads the main shard must refresh the CPU copy."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dist_opt, hdo, main, cpu_copy = _hybrid_optimizer_case()
    original(DistributedOptimizer, "_copy_model_params_to_main_params")(dist_opt)
    assert main.tolist() == cpu_copy.tolist() == [0.0] * 4  # megatron: returns early for the HDO
    hdo.param_update_in_fp32 = True
    with pytest.raises(KeyError):  # megatron: a resume refreshes precision-aware copies only
        original(HybridDeviceOptimizer, "_update_fp32_params_by_new_state")(hdo)

    dist_opt, hdo, main, cpu_copy = _hybrid_optimizer_case()
    DistributedOptimizer._copy_model_params_to_main_params(dist_opt)
    assert main.tolist() == cpu_copy.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert dist_opt.optimizer is hdo
    main.copy_(torch.tensor([7.0, 8.0, 9.0, 10.0]))
    hdo._update_fp32_params_by_new_state()
    assert cpu_copy.tolist() == [7.0, 8.0, 9.0, 10.0]


def test_expert_bias_counts_skip_padding_tokens():
    from megatron.core.transformer.moe.router import TopKRouter

    def router():
        return SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))

    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    padding = torch.tensor([False, False, True, True])  # the last two tokens are padding
    with pytest.raises(RuntimeError):  # megatron: [tokens, experts] & [tokens] broadcasts over experts
        original(TopKRouter, "_apply_expert_bias")(router(), routing_map, padding_mask=padding)
    r = router()
    TopKRouter._apply_expert_bias(r, routing_map, padding_mask=padding)
    assert r.local_tokens_per_expert.tolist() == [1.0, 1.0, 2.0]


def test_mtp_full_recompute_with_packed_sequence_params():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    layer = SimpleNamespace(
        config=SimpleNamespace(
            fp8=None, distribute_saved_activations=False, recompute_method="uniform", recompute_num_layers=1
        )
    )
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    def forward(hidden_states, packed_seq_params):
        assert packed_seq_params is params
        return hidden_states * 2

    x = torch.randn(5, 1, 4, requires_grad=True)
    with pytest.raises(TypeError, match="save_for_backward"):  # megatron: the params go to save_for_backward
        original(MultiTokenPredictionLayer, "_checkpointed_forward")(
            layer, forward, hidden_states=x, packed_seq_params=params
        )
    out = MultiTokenPredictionLayer._checkpointed_forward(layer, forward, hidden_states=x, packed_seq_params=params)
    out.sum().backward()
    torch.testing.assert_close(out, x.detach() * 2)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def _routed_rows_per_router(model, docs, padding_rows: int) -> dict[str, int]:
    """Expert-bias token counts (rows x top-k) of every router after one training forward of
    `docs` followed by a padding segment of `padding_rows` tokens flagged in the padding mask."""
    from moe_sft.models.forward import packed_batch

    tokens, positions, params = packed_batch([*docs, [0] * padding_rows])
    padding = torch.zeros_like(tokens, dtype=torch.bool)
    padding[:, tokens.shape[1] - padding_rows :] = True
    routers = {n: m for n, m in model.named_modules() if getattr(m, "local_tokens_per_expert", None) is not None}
    for router in routers.values():
        router.local_tokens_per_expert.zero_()
    model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params, padding_mask=padding)
    return {n: int(r.local_tokens_per_expert.sum()) for n, r in routers.items()}


def test_mtp_router_leaves_padding_out_like_the_decoder_routers(tmp_path, monkeypatch):
    """Tiny DeepSeek-V3 with an MTP layer (expert bias on): 20 real tokens then 12 padding tokens.
    Every router must count 20 rows x top-2; megatron's MTP layer counted the padding too."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from moe_sft.conversion.export import load_model_from_checkpoint
    from tests.deepseek_mtp import converted_tiny_deepseek_with_mtp

    _, _, tmp = converted_tiny_deepseek_with_mtp(tmp_path, 300)
    model = load_model_from_checkpoint(tmp / "mcore").train()
    model.run_mtp = True
    docs = [list(range(3, 14)), list(range(40, 49))]
    with monkeypatch.context() as m:  # megatron's own MTP path
        m.setattr(GPTModel, "_preprocess", original(GPTModel, "_preprocess"))
        m.setattr(MultiTokenPredictionLayer, "forward", original(MultiTokenPredictionLayer, "forward"))
        megatrons = _routed_rows_per_router(model, docs, padding_rows=12)
    fixed = _routed_rows_per_router(model, docs, padding_rows=12)
    mtp = [n for n in fixed if n.startswith("mtp.")]
    assert len(mtp) == 1 and len(fixed) == 2, fixed
    assert megatrons[mtp[0]] == 2 * 32  # padding rows routed and counted
    assert set(fixed.values()) == {2 * 20}, fixed


@needs_no_te
def test_output_discarding_checkpoint_has_no_fp8_without_te():
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    megatrons = CheckpointWithoutOutput.__new__(CheckpointWithoutOutput)
    original(CheckpointWithoutOutput, "__init__")(megatrons, fp8=False)
    assert megatrons.fp8 is True  # megatron: `fp8 is not None`; its forward then asks TE's FP8 state
    ckpt = CheckpointWithoutOutput(fp8=False)
    assert ckpt.fp8 is False
    x = torch.randn(3, requires_grad=True)
    y = ckpt.checkpoint(torch.nn.functional.silu, x)
    torch.testing.assert_close(y, torch.nn.functional.silu(x.detach()))


MLA_SEQ, MLA_HEADS = 6, 4


def _mla_qkv_grads(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One MLA layer's q/k/v at TP=`world` (no SP: k_pos_emb is full-sequence either way), the loss
    the same per head at every TP; saves the kv/q down projections' weight gradients and the input
    gradient, megatron's own `get_query_key_value_tensors` and then the fixed one."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from moe_sft.layers.spec import _mla_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        megatron_fixes.apply_megatron_fixes()
        cpu_compat.apply_cpu_compat()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        config = MLATransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=MLA_HEADS,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_head_dim=8,
            qk_pos_emb_head_dim=4,  # kv_combined: 12 columns, the last 4 (rank 1's at TP2) the rope key
            v_head_dim=8,
            rope_type="rope",
            tensor_model_parallel_size=world,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)  # CPU init builds every full weight, then keeps this rank's rows
        attn = build_module(_mla_attention(config), config=config, layer_number=1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(MLA_SEQ, 1, 32, generator=gen)
        grads_out = [torch.randn(MLA_SEQ, 1, MLA_HEADS, d, generator=gen) for d in (12, 12, 8)]  # q, k, v
        heads = slice(rank * MLA_HEADS // world, (rank + 1) * MLA_HEADS // world)
        results = {}
        for name, qkv in (
            ("megatron", original(MLASelfAttention, "get_query_key_value_tensors")),
            ("fixed", MLASelfAttention.get_query_key_value_tensors),
        ):
            attn.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            q, k, v = qkv(attn, xr)[:3]
            sum((t * g[:, :, heads]).sum() for t, g in zip((q, k, v), grads_out)).backward()
            results[name] = {
                "kv_down": attn.linear_kv_down_proj.weight.grad.clone(),
                "q_down": attn.linear_q_down_proj.weight.grad.clone(),
                "x": xr.grad.clone(),
            }
        torch.save(results, os.path.join(out_dir, f"tp{world}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_mla_rope_key_gradient_is_summed_over_tp(tmp_path):
    """megatron: at TP2 the kv down projection's rope rows get only the last rank's heads' share of
    k_pos_emb's gradient (and the input gradient inherits the error); fixed: equal to TP1."""
    import torch.multiprocessing as mp

    runs = [  # TP1 and TP2 side by side
        mp.start_processes(
            _mla_qkv_grads,
            args=(world, tempfile.mktemp(dir=tmp_path), str(tmp_path)),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        for world in (1, 2)
    ]
    for run in runs:
        while not run.join():
            pass
    ref = torch.load(tmp_path / "tp1_rank0.pt")["fixed"]
    tp2 = [torch.load(tmp_path / f"tp2_rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(ref, torch.load(tmp_path / "tp1_rank0.pt")["megatron"])  # TP1: no gather
    for name in ("megatron", "fixed"):
        kv_down = torch.cat([p[name]["kv_down"] for p in tp2])
        q_down = torch.cat([p[name]["q_down"] for p in tp2])
        if name == "megatron":
            rope_err = (kv_down[-4:] - ref["kv_down"][-4:]).abs().max() / ref["kv_down"][-4:].abs().max()
            print(f"megatron TP2: rope rows' grad rel. error {rope_err:.2e}")
            assert rope_err > 0.05
            torch.testing.assert_close(kv_down[:-4], ref["kv_down"][:-4])  # kv_compressed's rows are right
            assert not torch.allclose(tp2[0][name]["x"], ref["x"])
        else:
            torch.testing.assert_close(kv_down, ref["kv_down"])
            for p in tp2:
                torch.testing.assert_close(p[name]["x"], ref["x"])
        torch.testing.assert_close(q_down, ref["q_down"])  # q_compressed's gather was right all along
