"""Every patch moe-sft applies to torch or megatron-core, in one place, applied explicitly.

Two groups:

* `apply_megatron_fixes()` — always applied. Bugs of megatron-core 0.16.1 on the paths we use:
  without Transformer Engine (the fast path on GPUs without TE, and every CPU run), and the
  expert bias with padded micro-batches.
* `apply_cpu_compat()` — applied only when CUDA is absent (CI, laptops, the quickstart on CPU).
  megatron-core assumes CUDA in ~260 places (`device="cuda"`, `torch.cuda.current_device()`,
  streams, events, `Tensor.type()` asserts in the distributed optimizer and grad clipping).
  Instead of forking megatron-core we redirect those requests to the CPU: factory functions and
  `Tensor.to/.cuda` map CUDA devices to CPU, `torch.cuda` streams/events/synchronize become
  no-ops, and `Tensor.type()` reports `torch.cuda.*` names so type assertions pass. The trainer
  says at startup when this is active. Never applied when CUDA is available.

Each patch is gated on the megatron-core version it was written against and covered by
tests/cpu/test_compat.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

log = logging.getLogger(__name__)

TESTED_MCORE_VERSIONS = ("0.16.",)

_state = {"megatron_fixes": False, "cpu_compat": False}
# (owner, attribute) → (original, patched) for every CPU-compat patch, so it can be suspended.
_cpu_patches: dict[tuple[object, str], tuple[object, object]] = {}


def _mcore_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def apply_megatron_fixes() -> list[str]:
    """Fix megatron-core 0.16.1 problems that occur whenever Transformer Engine is absent."""
    if _state["megatron_fixes"]:
        return []
    applied = []
    if _mcore_version().startswith(TESTED_MCORE_VERSIONS):
        from megatron.core.transformer.moe import moe_utils

        # moe_utils imports `te_general_gemm` inside a try block that fails without TE, then the
        # router's fp32 gemm reads the name: NameError. None selects its torch.mm branch.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
            applied.append("moe_utils.te_general_gemm = None (router gemm without TE)")
            from moe_sft.layers.router_gemm import use_bf16_router_gemms

            use_bf16_router_gemms()
            applied.append("router fp32 logits from bf16 GEMMs on CUDA (as TE's), not fp32 GEMMs")
        from moe_sft.layers.router_topk import use_fused_routing

        use_fused_routing()
        applied.append("router score function, top-k and routing map: one Triton pass each way on CUDA")
        _fix_mla_without_te(applied)
        _fix_fully_reshardable_step_load()
        applied.append("DistributedOptimizer: torch Adam's per-parameter 'step' restored correctly on resume")
        _fix_hybrid_optimizer_main_params()
        applied.append("HybridDeviceOptimizer (optimizer CPU offload): main params and their CPU copies "
                       "follow loaded weights")
        _fix_expert_bias_padding_mask()
        applied.append("TopKRouter: expert-bias token counts exclude padding (mask broadcast per expert)")
        _fix_mtp_full_recompute_with_packed_sequences()
        applied.append("MTP layer full recompute: packed-sequence params kept out of save_for_backward")
        from moe_sft.layers.permute import use_gather_permutation

        use_gather_permutation()
        applied.append("token dispatchers: permute/unpermute by gathers, no atomic adds; dropless "
                       "dispatch without host syncs")
        from moe_sft.layers.one_rank_collectives import skip_one_rank_collectives

        skip_one_rank_collectives()
        applied.append("TP/EP collectives over one rank: the input itself, without megatron's identity autograd Function")
        from moe_sft.layers.rope import use_sync_free_rope

        use_sync_free_rope()
        applied.append("packed-sequence RoPE: no host syncs (CP 1); one Triton pass each way on CUDA")
        from moe_sft.models.mtp import use_sync_free_roll

        use_sync_free_roll()
        applied.append("MTP packed-sequence roll: one gather (no host syncs; CP 1)")
        from moe_sft.trainer.optimizer_kernels import use_foreach_grad_norm

        if use_foreach_grad_norm():
            applied.append("grad norm / clipping: torch foreach kernels (no apex/TE multi-tensor ops)")
        if _fix_output_discarding_checkpoint_without_te():
            applied.append("CheckpointWithoutOutput: no FP8 query without TE (layernorm/moe_act recompute)")
    _state["megatron_fixes"] = True
    return applied


def _fix_output_discarding_checkpoint_without_te() -> bool:
    """`CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None`, i.e. True, and its
    forward then asks TE's FP8GlobalStateManager, a NameError without TE: selective recompute of
    `layernorm` or `moe_act` crashed. Without TE there is no FP8, so the flag is False."""
    import importlib.util

    from megatron.core.tensor_parallel import random as mrandom

    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    cls = mrandom.CheckpointWithoutOutput
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__
    return True


def _fix_mla_without_te(applied: list[str]) -> None:
    """Without TE, megatron's TE extension module still imports (with mock classes), so
    multi_latent_attention sets HAVE_TE=True and then calls isinstance(x, <mock>): TypeError when
    building MLA. The flag must say what is true: TE is absent."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None and mla.HAVE_TE:
        mla.HAVE_TE = False
        applied.append("multi_latent_attention.HAVE_TE = False (TE absent; MLA builds)")


def _fix_fully_reshardable_step_load() -> None:
    """Without apex/TE, torch's Adam keeps a per-parameter 'step' tensor. megatron 0.16.1 saves
    the step once (in the common state) but `_set_main_param_and_optimizer_states` copies every
    state key from the loaded tensors, so resuming a fully_reshardable checkpoint dies with
    KeyError: 'step'. Keep the existing tensor for that key; load_state_dict restores the step.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_moe_sft_fixed", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = dict(tensors, step=state["step"].clone())
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states._moe_sft_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    # Same path, second bug: load_state_dict gives every parameter's state the *same* 'step'
    # tensor, and torch's Adam increments it in place once per parameter, so after a resume the
    # bias correction runs with a step count ~#params too high (the resume test caught it).
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for param_state in self.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
        return result

    DistributedOptimizer.load_state_dict = load_state_dict


def _fix_hybrid_optimizer_main_params() -> None:
    """Optimizer CPU offload (megatron's HybridDeviceOptimizer, HDO) without the precision-aware
    optimizer: the HDO steps the distributed optimizer's fp32 main-param shards, and copies the
    offloaded share to CPU when it is built. megatron 0.16.1 then loses loaded weights twice:
    `_copy_model_params_to_main_params` (reload_model_params, after loading a checkpoint's weights)
    returns early for an HDO, so the main params keep the values they had when the optimizer was
    built and the first step writes those back into the model (on H200: step-3 loss 6.139 with
    offload vs 6.188 without); and after a resume loads the main params, the HDO refreshes only
    precision-aware fp32 copies, not the CPU copies it steps (a KeyError here). Copy model -> main
    params as without offload, then main -> each CPU copy."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._copy_model_params_to_main_params
    if getattr(original, "_moe_sft_fixed", False):
        return

    def _copy_model_params_to_main_params(self, state_dict=None):
        hdo = self.optimizer
        if not isinstance(hdo, HybridDeviceOptimizer) or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, state_dict)
        self.optimizer = None  # megatron's path without an HDO: model params -> fp32 main shards
        try:
            original(self, state_dict)
        finally:
            self.optimizer = hdo
        hdo.refresh_cpu_copies()

    _copy_model_params_to_main_params._moe_sft_fixed = True
    DistributedOptimizer._copy_model_params_to_main_params = _copy_model_params_to_main_params

    def refresh_cpu_copies(self):
        for main_param, cpu_copy in self.gpu_params_map_cpu_copy.items():
            if main_param not in self.param_to_fp32_param:  # precision-aware copies: original path
                cpu_copy.data.copy_(main_param.data)

    def _update_fp32_params_by_new_state(self):
        if self.param_update_in_fp32:
            for param, state in self.state.items():
                if param in self.param_to_fp32_param:
                    self.param_to_fp32_param[param].data.copy_(state["master_param"])
        self.refresh_cpu_copies()

    HybridDeviceOptimizer.refresh_cpu_copies = refresh_cpu_copies
    HybridDeviceOptimizer._update_fp32_params_by_new_state = _update_fp32_params_by_new_state


def _fix_mtp_full_recompute_with_packed_sequences() -> None:
    """`MultiTokenPredictionLayer._checkpointed_forward` hands every keyword argument, the
    `PackedSeqParams` of THD batches included, to `tensor_parallel.checkpoint` as a positional input,
    whose `save_for_backward` accepts tensors only: DeepSeek-V3 with MTP, full recompute and packed
    sequences (our recipe) died on the first step with "save_for_backward can only save variables".
    Non-tensor arguments are bound in a closure instead (recomputation gets the same objects);
    tensors still go through the checkpoint, hidden states first. FP8 (TE's checkpoint, which takes
    keywords) keeps megatron's own path."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    original = MultiTokenPredictionLayer._checkpointed_forward

    @functools.wraps(original)
    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if self.config.fp8:
            return original(self, forward_func, *args, **kwargs)
        tensor_names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        bound = {k: v for k, v in kwargs.items() if k not in tensor_names}

        def run(*tensors):
            return forward_func(*args, **bound, **dict(zip(tensor_names, tensors)))

        return original(self, run, *(kwargs[k] for k in tensor_names))

    MultiTokenPredictionLayer._checkpointed_forward = _checkpointed_forward


def _fix_expert_bias_padding_mask() -> None:
    """`TopKRouter._apply_expert_bias` masks the [tokens, experts] routing map with the [tokens]
    padding mask (`routing_map & ~padding_mask`), which broadcasts over the wrong dimension: any
    expert-bias model (DeepSeek-V3) with padded micro-batches (pipeline parallel, the allgather
    dispatcher) crashes. Padding rows must simply not count towards the bias update."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


# --------------------------------------------------------------------------------------------
# CPU emulation of the CUDA calls megatron-core makes
# --------------------------------------------------------------------------------------------

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "as_tensor", "linspace", "eye", "empty_strided", "randperm",
)


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # megatron passes torch.cuda.current_device() (an int)
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_device(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def _patched_to(orig_to):
    @functools.wraps(orig_to)
    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if args and (_is_cuda_device(args[0]) and not isinstance(args[0], bool)):
            args = (torch.device("cpu"),) + tuple(args[1:])
        return orig_to(self, *args, **kwargs)

    return to


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _patched_type(orig_type):
    @functools.wraps(orig_type)
    def type_(self, *args, **kwargs):
        if not args and not kwargs:
            # distributed optimizer and clip_grads assert 'torch.cuda.FloatTensor' etc.
            return _CUDA_TYPE_NAMES.get(self.dtype, orig_type(self))
        return orig_type(self, *args, **kwargs)

    return type_


class _NullStream:
    """Stand-in for torch.cuda.Stream / ExternalStream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cuda_stubs() -> dict:
    null_stream = _NullStream()
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Stream": _NullStream,
        "ExternalStream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda *a, **k: null_stream,
        "default_stream": lambda *a, **k: null_stream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "set_stream": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
        # The CUDA RNG tracker forks "CUDA" RNG states; on CPU the CPU generator plays that role.
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly)
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
    }


def _patch_rng_tracker():
    """megatron's RNG tracker reads and writes the CUDA generator (`torch.cuda.random.*`,
    `torch.cuda.default_generators`): the CPU generator stands in. The tracker forks it around
    sequence-parallel regions (TP>1)."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    _patch(mrandom, "_get_cuda_rng_state", _get_cuda_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _set_cuda_rng_state)


def _patch_yarn_rope():
    """YarnRotaryEmbedding enters `with torch.device(torch.cuda.current_device())` unless told to
    initialise on CPU, and MLA does not pass that flag: force it (a context manager is not one of
    the factory functions we redirect)."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    cls = yarn.YarnRotaryEmbedding
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original_init(self, *args, **kwargs)

    _patch(cls, "__init__", __init__)


def apply_cpu_compat() -> list[str]:
    """Redirect megatron-core's CUDA requests to the CPU. Only for machines without CUDA."""
    if _state["cpu_compat"]:
        return []
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_compat() is for machines without CUDA; this one has CUDA.")
    version = _mcore_version()
    if not version.startswith(TESTED_MCORE_VERSIONS):
        log.warning("CPU compat was written for megatron-core %s, found %s", TESTED_MCORE_VERSIONS,
                    version)
    # torch.device("meta") as a context looks factories up in an lru_cached set built from the
    # torch namespace on first use: build it now, while it still names the unwrapped functions
    # (the wrappers call those, so `with torch.device("meta")` keeps working afterwards).
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _wrap_factory(getattr(torch, name)))
    _patch(torch.Tensor, "to", _patched_to(torch.Tensor.to))
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.Tensor, "type", _patched_type(torch.Tensor.type))
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    for name, stub in _cuda_stubs().items():
        _patch(torch.cuda, name, stub)
    _patch(torch.cuda, "nvtx", types.SimpleNamespace(
        range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext()))
    _patch_rng_tracker()
    _patch_yarn_rope()
    # megatron torch.compile's its fused elementwise functions (SwiGLU, bias-dropout-add). On CPU
    # inductor spends ~5 s per process compiling them and recompiles for new packed shapes, for
    # no gain at CPU sizes (a 2-step quickstart run: 27.6 s -> 20.9 s, the same losses).
    _patch(torch._dynamo.config, "disable", True)
    _state["cpu_compat"] = True
    return ["torch factories/Tensor.to/.cuda map CUDA to CPU", "torch.cuda streams/events stubbed",
            "Tensor.type() reports torch.cuda.* names", "CUDA RNG tracker uses the CPU generator",
            "torch.compile off (megatron's fused elementwise functions run eager)"]


def _patch(owner, name: str, new) -> None:
    _cpu_patches[(owner, name)] = (getattr(owner, name, None), new)
    setattr(owner, name, new)


@contextlib.contextmanager
def suspended():
    """Run code that is not megatron's (transformers model loading) with torch unpatched.

    transformers builds models on the meta device and then materialises non-persistent buffers
    (e.g. rotary `inv_freq`); under the factory wrappers those came out uninitialised. HF models
    are therefore loaded (and run) inside this context.
    """
    if not _state["cpu_compat"]:
        yield
        return
    for (owner, name), (orig, _new) in _cpu_patches.items():
        setattr(owner, name, orig)
    try:
        yield
    finally:
        for (owner, name), (_orig, new) in _cpu_patches.items():
            setattr(owner, name, new)


def cpu_compat_active() -> bool:
    return _state["cpu_compat"]
