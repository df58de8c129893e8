"""CPU emulation of the CUDA calls megatron-core makes, for machines without CUDA (CI, laptops,
the quickstart on CPU).

megatron-core assumes CUDA in ~260 places (`device="cuda"`, `torch.cuda.current_device()`,
streams, events, `Tensor.type()` asserts in the distributed optimizer and grad clipping).
Instead of forking megatron-core we redirect those requests to the CPU: factory functions and
`Tensor.to/.cuda` map CUDA devices to CPU, `torch.cuda` streams/events/synchronize become
no-ops, and `Tensor.type()` reports `torch.cuda.*` names so type assertions pass. The trainer
says at startup when this is active. Never applied when CUDA is available
(tests/cpu/test_cpu_compat.py). Every patch is a swap in runtime/patches.py (group "cpu_compat").
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from moe_sft.runtime import patches
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

TESTED_MCORE_VERSIONS = ("0.16.",)

GROUP = "cpu_compat"


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "as_tensor",
    "linspace",
    "eye",
    "empty_strided",
    "randperm",
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
        kwargs.pop("pin_memory", None)  # no pinned allocator without CUDA (megatron's CP rope index)
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

    _patch(mrandom, "_get_cuda_rng_state", _get_cuda_rng_state, "CUDA RNG tracker: the CPU generator")
    _patch(mrandom, "_set_cuda_rng_state", _set_cuda_rng_state, "CUDA RNG tracker: the CPU generator")


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

    _patch(cls, "__init__", __init__, "YaRN rope initialised on CPU")


def apply_cpu_compat() -> list[str]:
    """Redirect megatron-core's CUDA requests to the CPU. Only for machines without CUDA."""
    if cpu_compat_active():
        return []
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_compat() is for machines without CUDA; this one has CUDA.")
    version = patches.mcore_version()
    if not version.startswith(TESTED_MCORE_VERSIONS):
        log.warning("CPU compat was written for megatron-core %s, found %s", TESTED_MCORE_VERSIONS, version)
    # torch.device("meta") as a context looks factories up in an lru_cached set built from the
    # torch namespace on first use: build it now, while it still names the unwrapped functions
    # (the wrappers call those, so `with torch.device("meta")` keeps working afterwards).
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _wrap_factory(getattr(torch, name)), "CUDA device requests land on CPU")
    _patch(torch.Tensor, "to", _patched_to(torch.Tensor.to), "CUDA device requests land on CPU")
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self, "CUDA device requests land on CPU")
    _patch(torch.Tensor, "type", _patched_type(torch.Tensor.type), "megatron's type asserts see torch.cuda.*")
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self, "CUDA device requests land on CPU")
    for name, stub in _cuda_stubs().items():
        _patch(torch.cuda, name, stub, "torch.cuda stubbed")
    _patch(
        torch.cuda,
        "nvtx",
        types.SimpleNamespace(
            range_push=lambda *a, **k: None,
            range_pop=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
        ),
        "torch.cuda stubbed",
    )
    _patch_rng_tracker()
    _patch_yarn_rope()
    # megatron torch.compile's its fused elementwise functions (SwiGLU, bias-dropout-add). On CPU
    # inductor spends ~5 s per process compiling them and recompiles for new packed shapes, for
    # no gain at CPU sizes (a 2-step quickstart run: 27.6 s -> 20.9 s, the same losses).
    _patch(torch._dynamo.config, "disable", True, "megatron's fused elementwise functions run eager")
    return [
        "torch factories/Tensor.to/.cuda map CUDA to CPU",
        "torch.cuda streams/events stubbed",
        "Tensor.type() reports torch.cuda.* names",
        "CUDA RNG tracker uses the CPU generator",
        "torch.compile off (megatron's fused elementwise functions run eager)",
    ]


def _patch(owner, name: str, new, reason: str) -> None:
    patches.swap(owner, name, new, group=GROUP, reason=reason)


def remove_cpu_compat() -> int:
    """Put back torch's and megatron's own objects; returns how many attributes."""
    return patches.restore(GROUP)


@contextlib.contextmanager
def suspended():
    """Run code that is not megatron's (transformers model loading) with torch unpatched.

    transformers builds models on the meta device and then materialises non-persistent buffers
    (e.g. rotary `inv_freq`); under the factory wrappers those came out uninitialised. HF models
    are therefore loaded (and run) inside this context.
    """
    with patches.suspended(GROUP):
        yield


def cpu_compat_active() -> bool:
    return bool(patches.active(GROUP))
