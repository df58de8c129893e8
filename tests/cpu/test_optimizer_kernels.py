"""use_fused_adam: megatron's torch AdamW switched to torch's fused kernel, same updates, kept
across a state-dict load."""

import copy
from types import SimpleNamespace

import pytest
import torch

from moe_sft.config import KernelsConfig
from moe_sft.kernels import install
from moe_sft.kernels.optimizer import use_fused_adam
from moe_sft.runtime import cpu_compat, megatron_fixes


@pytest.fixture
def megatron_on_this_machine():
    """megatron's fallbacks put their result on "cuda": map that to the CPU where CUDA is absent."""
    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    if not torch.cuda.is_available():
        cpu_compat.apply_cpu_compat()


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 3, 2))]


def _run(optimizer, params, steps=4):
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.sin(p.detach() * (step + 1) + i)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_fused_updates_equal_the_default_implementation_and_survive_a_load():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_params, fused_params = _params(), _params()
    reference = torch.optim.AdamW(ref_params, **kw)
    inner = torch.optim.AdamW(fused_params, **kw)
    chained = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=inner), SimpleNamespace(optimizer=object())]
    )  # e.g. a hybrid offload
    assert use_fused_adam(chained) == 1
    assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
    for a, b in zip(_run(reference, ref_params), _run(inner, fused_params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # a resume loads groups saved without the flag: the next step is fused again, same result
    saved = reference.state_dict()
    inner.load_state_dict(copy.deepcopy(saved))  # torch's load keeps the given tensors: no sharing
    reference.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(_run(reference, ref_params, 2), _run(inner, fused_params, 2)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(g["fused"] for g in inner.param_groups)


def test_integer_parameters_are_left_alone():
    opt = torch.optim.AdamW(
        [
            torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
            torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False),
        ]
    )
    assert use_fused_adam(SimpleNamespace(optimizer=opt)) == 0
    assert not opt.param_groups[0].get("fused")


def test_foreach_grad_norm_and_scale_equal_megatron_local_fallbacks(megatron_on_this_machine):
    from megatron.core import utils

    from moe_sft.kernels.optimizer import _foreach_l2_norm, _foreach_scale

    grads = [t.clone() for t in _params(3)]
    ref, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    mine, _ = _foreach_l2_norm(0, None, [grads], False)
    assert mine.shape == ref.shape == (1,) and mine.dtype == torch.float32
    torch.testing.assert_close(mine, ref)
    in_place, expected = [g.clone() for g in grads], [g * 0.25 for g in grads]
    _foreach_scale(0, None, [in_place, in_place], 0.25)
    into = [torch.empty_like(g) for g in grads]
    _foreach_scale(0, None, [grads, into], 0.25)
    for a, b, c in zip(in_place, into, expected):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_megatron_clip_grads_uses_them_once_installed(megatron_on_this_machine):
    from megatron.core.optimizer import clip_grads

    from moe_sft.kernels import optimizer as optimizer_kernels

    assert clip_grads.l2_norm_impl is optimizer_kernels._foreach_l2_norm
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    # get_grad_norm_fp32's call (it then all-reduces the result over its groups)
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, None, [[p.grad for p in params]], False)
    assert float(norm) == pytest.approx(4.0)  # sqrt(3*4 + 4*1)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(params[0].grad, torch.full((3,), 0.5), rtol=1e-5, atol=0)


# ----------------------------------------------------------------- clip handed to the Adam kernel


STAND_IN_MODEL_WRITES = []


def _kernel_stand_in(
    param, grad, exp_avg, exp_avg_sq, step, hyper, *, decoupled, weight_decay, grad_coeff, model_param=None
):
    """adam_kernel.adam_step's contract (clip multiply in fp32, then torch's fused Adam math, the
    step already counted, the result cast into `model_param`) through torch's CPU kernels: the Triton
    kernel itself needs a GPU (tests/gpu/test_gpu_adam.py); this checks what megatron's step hands it."""
    from moe_sft.kernels import adam as k

    h = hyper.tolist()
    g = grad * torch.tensor(h[k.GRAD_COEFF], dtype=torch.float32) if grad_coeff else grad
    update = torch._fused_adamw_ if decoupled else torch._fused_adam_
    update(
        [param],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=h[k.LR],
        beta1=h[k.BETA1],
        beta2=h[k.BETA2],
        weight_decay=h[k.WEIGHT_DECAY] if weight_decay else 0.0,
        eps=h[k.EPS],
        amsgrad=False,
        maximize=False,
    )
    if model_param is not None:
        model_param.copy_(param)
        STAND_IN_MODEL_WRITES.append(model_param.numel())


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def two_megatron_optimizers(request):
    """The same tiny Qwen3-MoE twice, each under megatron DDP + the distributed optimizer (chained,
    as get_megatron_optimizer returns it); the second steps through use_triton_adam's path. In bf16
    the kernel also writes the model parameters megatron's main-to-model copy would."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from moe_sft.conversion.single_rank import build_single_rank_model, init_single_rank
    from moe_sft.models import registry

    family = registry.family_by_name("qwen3_moe")
    init_single_rank()
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        module = build_single_rank_model(family, family.tiny_hf_config(num_hidden_layers=2), request.param)
        ddp = DistributedDataParallel(
            config=module.config,
            module=module,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-2,
                weight_decay=0.1,
                clip_grad=1.0,
                use_distributed_optimizer=True,
                bf16=request.param == "bf16",
            ),
            [ddp],
        )
        use_fused_adam(opt)
        pairs.append((ddp, opt))
    return pairs


def _set_grads(ddp, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ddp.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * scale)


def test_the_clip_handed_to_the_kernel_gives_megatrons_step(two_megatron_optimizers, monkeypatch, recwarn):
    from moe_sft.kernels import adam as adam_kernel
    from moe_sft.kernels import optimizer as optimizer_kernels
    from moe_sft.trainer import guard

    (ref_model, reference), (model, optimizer) = two_megatron_optimizers
    assert not optimizer_kernels.use_triton_adam(optimizer), "CPU parameters: the kernel path stays off"
    monkeypatch.setattr(adam_kernel, "supported", lambda p: p.dtype == torch.float32)
    monkeypatch.setattr(adam_kernel, "adam_step", _kernel_stand_in)
    done = optimizer_kernels.use_triton_adam(optimizer)
    bf16 = next(model.module.parameters()).dtype == torch.bfloat16
    assert done and ("writes the bf16 model parameters" in done) == bf16, done
    slices = [inner.optimizer.__dict__.get("_model_param_slices") for inner in optimizer.chained_optimizers]
    assert all(slices) == bf16, "bf16 slices collected exactly when the model is bf16"
    copies = []  # megatron's main-to-model copy, by step: skipped when the kernel wrote every slice
    for inner in optimizer.chained_optimizers:
        original = type(inner)._copy_main_params_to_model_params
        monkeypatch.setattr(
            type(inner),
            "_copy_main_params_to_model_params",
            lambda self, original=original: copies.append(step) or original(self),
        )
    STAND_IN_MODEL_WRITES.clear()
    # scales: clipped (norm ~100), unclipped (norm < 1), a non-finite norm (skipped), clipped again
    for step, scale in enumerate((1.0, 1e-3, float("nan"), 0.3)):
        for m in (ref_model, model):
            _set_grads(m, step, scale)
        expected = guard.step_unless_non_finite(reference, 0.0)
        got = guard.step_unless_non_finite(optimizer, 0.0)
        assert got[0] == expected[0] == (scale == scale), (step, got, expected)
        assert got[1] == expected[1] or (got[1] != got[1] and expected[1] != expected[1])
        for inner in optimizer.chained_optimizers:
            assert "_grad_coeff" not in inner.optimizer.__dict__  # consumed or never set
        for (name, a), b in zip(ref_model.module.named_parameters(), model.module.parameters()):
            assert torch.equal(a, b), (step, name)
    # the reference's copies run too (same class): with the kernel writing, only they remain
    inner_count = len(optimizer.chained_optimizers)
    assert copies == [s for s in (0, 1, 3) for _ in range(inner_count * (1 if bf16 else 2))], copies
    assert sum(STAND_IN_MODEL_WRITES) == (3 * sum(sum(m.numel() for m, _ in s.values()) for s in slices) if bf16 else 0)
    states = [s for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()]
    ref_states = [s for inner in reference.chained_optimizers for s in inner.optimizer.state.values()]
    assert [float(s["step"]) for s in states] == [float(s["step"]) for s in ref_states] == [3.0] * len(states)
    for a, b in zip(ref_states, states):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert not [w for w in recwarn if "bf16 parameter slices" in str(w.message)]
    if bf16:  # a main parameter replaced since startup: megatron's copy runs, and the run says so once
        key = next(iter(slices[0]))
        slices[0][key] = (slices[0][key][0].clone(), slices[0][key][1])
        for m in (ref_model, model):
            _set_grads(m, 7, 1.0)
        guard.step_unless_non_finite(reference, 0.0)
        with pytest.warns(UserWarning, match="bf16 parameter slices"):
            guard.step_unless_non_finite(optimizer, 0.0)
        for a, b in zip(ref_model.module.parameters(), model.module.parameters()):
            assert torch.equal(a, b)
    # the A/B switch: off, megatron's own step again
    monkeypatch.setattr(optimizer_kernels, "ENABLED", False)
    for m in (ref_model, model):
        _set_grads(m, 9, 1.0)
    assert guard.step_unless_non_finite(reference, 0.0) == guard.step_unless_non_finite(optimizer, 0.0)
    for a, b in zip(ref_model.module.parameters(), model.module.parameters()):
        assert torch.equal(a, b)
