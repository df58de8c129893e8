"""moe_sft/kernels/install.py: kernels.fused switches every global swap on and off, and a tiny model
trains the same either way (fp32 on CPU: the kernels compute what megatron's functions compute)."""

from __future__ import annotations

import pytest
import torch

from moe_sft.config import KernelsConfig
from moe_sft.kernels import install
from moe_sft.models import qwen3_moe
from tests.train_steps import adam_steps, random_batches

VOCAB = 300


@pytest.fixture
def restore_defaults():
    yield
    install.install(KernelsConfig())


def test_off_restores_megatron_s_functions_and_on_installs_ours(restore_defaults):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import router, token_dispatcher

    from moe_sft.kernels import cross_entropy, permute, rms_norm, rope, router_topk, wgrad

    install.install(KernelsConfig(fused=False))
    megatron = (token_dispatcher.permute, router.topk_routing_with_score_function, rope_utils._apply_rotary_pos_emb_thd)
    assert megatron[0].__module__.startswith("megatron.") and megatron[2].__module__.startswith("megatron.")
    assert not cross_entropy.ENABLED and not wgrad.ENABLED and not rms_norm.ENABLED
    lines = install.install(KernelsConfig(wgrad_overlap=False))
    assert token_dispatcher.permute is permute.permute
    assert router.topk_routing_with_score_function is router_topk.topk_routing_with_score_function
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rope_thd
    assert cross_entropy.ENABLED and wgrad.ENABLED and rms_norm.ENABLED and not wgrad.OVERLAP and len(lines) >= 6
    install.install(KernelsConfig(fused=False))
    assert (
        token_dispatcher.permute,
        router.topk_routing_with_score_function,
        rope_utils._apply_rotary_pos_emb_thd,
    ) == megatron


def test_a_tiny_model_trains_the_same_with_kernels_off_and_on(restore_defaults):
    from moe_sft.conversion.single_rank import single_rank_model

    hf_cfg = qwen3_moe.tiny_hf_config(vocab_size=VOCAB)
    batches = random_batches(VOCAB, (24, 31))

    def losses(fused: bool) -> list[float]:
        torch.manual_seed(0)
        model = single_rank_model(qwen3_moe.FAMILY, hf_cfg)
        install.install(KernelsConfig(fused=fused))  # after single_rank_model's own (default) install
        return adam_steps(model, batches, VOCAB, "cpu", steps=2, lr=3e-3)[0]

    off, on = losses(False), losses(True)
    assert len(off) == 2 and off[1] != off[0]
    torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=1e-5, atol=1e-6)


def _moe_sft_objects_in_megatron() -> list[str]:
    """Every attribute of a loaded megatron module, or of a class it defines, holding an object that
    moe-sft's kernels define."""
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        owners = [module] + [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if str(getattr(value, "__module__", "")).startswith("moe_sft.kernels"):
                    found.append(f"{getattr(owner, '__name__', owner)}.{attr}")
    return found


def test_fused_false_after_a_fused_install_runs_megatron_s_own_functions_only(restore_defaults):
    from megatron.core.transformer.moe import token_dispatcher

    from moe_sft.kernels import permute
    from moe_sft.runtime import patches

    install.install(KernelsConfig(fused=True))
    assert token_dispatcher.MoEAllGatherTokenDispatcher.token_combine is permute._allgather_combine
    install.install(KernelsConfig(fused=False))
    assert _moe_sft_objects_in_megatron() == []
    assert patches.active(patches.KERNELS) == []


# Runs in a fresh interpreter: snapshots every attribute of the megatron (and torch) namespaces
# the groups touch, installs every group, uninstalls it, and compares object identities.
_EVERY_GROUP = """
import importlib, sys, types
import torch
MODULES = [
    "megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.experts", "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.multi_token_prediction", "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.cpu_offloading",
    "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
    "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings", "megatron.core.distributed.param_and_grad_buffer",
    "moe_sft.kernels.install", "moe_sft.kernels.dense_wgrad", "moe_sft.kernels.wgrad",
    "moe_sft.peft.fp8_loading", "moe_sft.runtime.cpu_compat", "moe_sft.runtime.megatron_fixes",
] + ["moe_sft.kernels." + m for m in ("frozen_linear", "mtp_roll", "one_rank_collectives", "optimizer",
     "permute", "rope", "router_gemm", "router_topk")]
for m in MODULES:
    importlib.import_module(m)

def owners():
    out = [torch, torch.Tensor, torch.nn.Module, torch.cuda]
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            out.append(module)
            out += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
    return out

def snapshot():
    snap = {(id(o), a): (o, a, v) for o in owners() for a, v in list(vars(o).items())}
    snap["dynamo.disable"] = (None, "disable", torch._dynamo.config.disable)
    return snap

before = snapshot()
from moe_sft.config import KernelsConfig
from moe_sft.kernels import dense_wgrad, install, wgrad
from moe_sft.peft import fp8_loading
from moe_sft.runtime import cpu_compat, megatron_fixes, patches

assert megatron_fixes.apply_megatron_fixes() and cpu_compat.apply_cpu_compat()
install.install(KernelsConfig(fused=True))
wgrad.guard_grad_sync()
dense_wgrad.use_torch_wgrad_accum()
groups = {p.group for p in patches.active()}
assert groups == {"megatron_fixes", "cpu_compat", "kernels"}, groups
with fp8_loading.placeholder_base():
    assert patches.active("fp8_placeholders")
swapped = {(id(p.owner), p.attr) for p in patches.active()}
missed = [f"{o}.{a}" for k, (o, a, v) in before.items() if k != "dynamo.disable" and k not in swapped
          and vars(o).get(a, v) is not v]
install.install(KernelsConfig(fused=False))
cpu_compat.remove_cpu_compat()
megatron_fixes.remove_megatron_fixes()
after = snapshot()
changed = [f"{o}.{a}" for k, (o, a, v) in before.items() if k not in after or after[k][2] is not v]
added = [f"{o}.{a}" for k, (o, a, v) in after.items() if k not in before and not isinstance(v, types.ModuleType)]
assert not patches.active(), patches.active()
print("swapped", len(swapped), "changed", changed, "added", added, "missed", missed)
assert not changed and not added and not missed
"""


def test_every_group_installs_and_uninstalls_back_to_megatron_s_original_objects():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _EVERY_GROUP], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "swapped" in run.stdout and int(run.stdout.split()[1]) > 60


def test_registry_restores_absent_and_inherited_attributes_and_refuses_a_second_group():
    import types

    from moe_sft.runtime import patches

    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("owner")
    assert patches.swap(Child, "f", lambda self: "new", group="test.a", reason="r") is Base.f
    patches.swap(module, "absent", 1, group="test.a", reason="r")
    with pytest.raises(RuntimeError, match="already replaced by group 'test.a'"):
        patches.swap(module, "absent", 2, group="test.b", reason="r")
    with patches.suspended("test.a"):
        assert Child().f() == "base" and not hasattr(module, "absent")
    assert Child().f() == "new" and module.absent == 1 and patches.original(Child, "f") is Base.f
    assert patches.restore("test.a") == 2
    assert "f" not in vars(Child) and not hasattr(module, "absent") and patches.active("test.a") == []
