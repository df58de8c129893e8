"""The one layout object (moe_sft/config/layout.py) and the assembly steps that read it."""

import pytest

from moe_sft.config import ConfigError, load_config
from moe_sft.config.layout import Layout
from tests.cpu.test_plan import REPO, _recipe, _reset_world, build_rank


def _cfg(*overrides: str):
    return load_config(["--config-path", str(REPO / "recipes"), "--config-name", "quickstart", *overrides])


def test_degrees_expert_group_and_data_parallel_sizes():
    cfg = _cfg(
        "parallel.tensor_model_parallel_size=2",
        "parallel.expert_model_parallel_size=4",
        "parallel.pipeline_model_parallel_size=2",
    )
    lay = Layout.from_config(cfg, 16)
    assert (lay.expert_group, lay.etp) == (8, 2)  # expert-TP null = TP
    assert (lay.dp, lay.edp, lay.exact_dp(), lay.exact_edp()) == (4, 1, 4, 1)
    assert Layout.from_config(cfg, 12).exact_edp() is None


@pytest.mark.parametrize(
    "requested, device, ep, topk, dispatcher, fixed",
    [
        ("auto", "cpu", 1, 2, "allgather", False),
        ("auto", "cuda", 1, 8, "alltoall", False),
        ("auto", "cuda", 4, 8, "allgather", True),
        ("auto", "cuda", 16, 8, "alltoall", False),
        ("alltoall", "cuda", 4, 8, "alltoall", False),
        ("allgather", "cuda", 16, 8, "allgather", True),
    ],
)
def test_the_dispatcher_auto_stands_for_and_the_fixed_shape(requested, device, ep, topk, dispatcher, fixed):
    cfg = _cfg(f"parallel.expert_model_parallel_size={ep}", f"model.moe_token_dispatcher_type={requested}")
    lay = Layout.from_config(cfg, 16, topk=topk, device=device)
    assert (lay.dispatcher, lay.fixed_shape) == (dispatcher, fixed)


def test_static_rows_need_the_allgather_the_gathered_bound_or_graphs_and_the_fused_kernels():
    cfg = _cfg("parallel.expert_model_parallel_size=2", "data.pack_length=4096")
    lay = Layout.from_config(cfg, 2, topk=8)
    assert lay.static_rows and lay.reduced_combine
    assert not Layout.from_config(
        _cfg("parallel.expert_model_parallel_size=2", "data.pack_length=8192"), 2, topk=8
    ).static_rows
    forced = _cfg("parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall")
    assert not Layout.from_config(forced, 2, topk=8).static_rows
    unfused = _cfg("parallel.expert_model_parallel_size=2", "data.pack_length=4096", "kernels.fused=false")
    assert not Layout.from_config(unfused, 2, topk=8).static_rows
    assert not Layout.from_config(unfused, 2, topk=8).reduced_combine


def test_the_planner_plans_static_row_padding_only_for_the_dispatcher_and_kernels_that_have_it(monkeypatch):
    """A recipe forcing the alltoall (or kernels.fused=false) has no static rows: its plan holds no
    padding for them (1 < EP2 <= top-8 is where `auto` would pick the allgather)."""
    from moe_sft.plan import make_plan, memory

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    small = ("parallel.expert_model_parallel_size=2", "data.pack_length=2048", "data.max_seq_len=2048")

    def padding(*overrides):
        plan = make_plan(_recipe("qwen3_30b_a3b_h200", *small, *overrides))
        return memory.static_rows_padding(plan.shape, plan.layout, plan.train)

    assert padding() == 2.0
    assert padding("model.moe_token_dispatcher_type=alltoall") == 1.0
    assert padding("kernels.fused=false") == 1.0


@pytest.fixture
def tiny_ep2():
    """Rank 0 of an EP2 world of the tiny Qwen3-MoE (fake process group), allgather dispatcher."""
    from moe_sft.kernels import install as kernels_install
    from moe_sft.models import qwen3_moe
    from moe_sft.runtime import device as rdevice

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    _reset_world()
    yield build_rank(
        qwen3_moe.FAMILY, qwen3_moe.tiny_hf_config(num_hidden_layers=2), 0, 2, ep=2, etp=1, dispatcher="allgather"
    )
    _reset_world()


def _ep2_layout(*overrides: str) -> Layout:
    return Layout.from_config(_cfg("parallel.expert_model_parallel_size=2", *overrides), 2, topk=2, device="cpu")


def test_unfused_kernels_turn_on_no_static_rows_or_bf16_combine_and_the_log_does_not_claim_them(tiny_ep2):
    from moe_sft.kernels import permute
    from moe_sft.trainer import assemble

    dispatchers = [d for _, d in permute._allgather_dispatchers(tiny_ep2)]
    assert len(dispatchers) == 2
    fused = _ep2_layout()
    assert assemble.static_rows(tiny_ep2, fused, 2.0) == [
        "2 MoE layers permute a static row count per rank: no host wait in their dispatch"
    ]
    assert all(d.moe_sft_static_rows for d in dispatchers)
    assert "reduce-scatters in bf16" in assemble.combine_dtype(tiny_ep2, fused, "bf16")[0]

    for d in dispatchers:
        del d.moe_sft_combine_dtype
    unfused = _ep2_layout("kernels.fused=false")
    assert assemble.static_rows(tiny_ep2, unfused, 2.0) == []
    assert not any(d.moe_sft_static_rows for d in dispatchers)
    lines = assemble.combine_dtype(tiny_ep2, unfused, "bf16")
    assert lines == ["model.moe_combine_dtype=bf16 is inactive: kernels.fused=false runs megatron's fp32 combine"]
    assert not any(hasattr(d, "moe_sft_combine_dtype") for d in dispatchers)


def test_validation_reads_the_layout_for_graphs_past_top_k():
    from moe_sft.config.validate import validate_against_model

    cfg = _cfg("parallel.expert_model_parallel_size=4", "trainer.cuda_graphs=true")
    with pytest.raises(ConfigError, match="EP x expert-TP = 4 > top-k 2"):
        validate_against_model(cfg, 2, 8, 4, 4, 128, expert_biases=False, topk=2)
