"""Per-phase time of a training step from torch.profiler, forward and backward.

Method: while a few steps run under torch.profiler, every module of interest is wrapped in a
`record_function("phase::<name>")` scope (a forward pre-hook enters it, a forward hook leaves it),
and so are the non-module parts (the MoE token dispatcher's methods, the loss function, gradient
finalisation, the optimizer step). Each profiled op then gets the phase of its innermost scope.
Backward ops run outside those scopes (autograd's engine, often on another thread); the profiler
tags each backward node (`autograd::engine::evaluate_function: XBackward0`) with the sequence
number of the forward op that created it, so a backward op gets the phase its forward op had.
Gradient accumulation nodes (`AccumulateGrad`, where megatron's DDP hooks add into main_grad) are
counted under `grads`. The time of an op is its own CUDA kernel time (self device time: kernels
it launched, not its children's) on a GPU, its own CPU time on CPU; kernels the profiler could not
tie to an op go to `other`. Summed over phases this is the GPU busy time, never more than the
step's wall time unless kernels overlap on several streams (communication).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

import torch
from torch.autograd.profiler import record_function

SCOPE = "phase::"
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# The profiler's own bookkeeping (CUPTI's overhead records). kineto can list them among an op's
# kernels (which can double a phase), and it also records them as host events of their own with
# "kernels" attached: "Command Buffer Full" (the host waiting for room in the launch queue), which
# inflated the comparison arms' optimizer phase by seconds (docs/log.md). Neither kind is work on
# the GPU.
PROFILER_OVERHEAD = {"Buffer Flush", "Activity Buffer Request", "Command Buffer Full"}
# Kernels launched straight through Triton's launcher outside any torch op: the profiler ties them to
# no CPU op, so without this they land in "other". The clip + Adam kernel runs in the optimizer's
# step, outside autograd (the layers' kernels run inside autograd Functions and are tied to those).
KERNEL_PHASES = {"_adam_kernel": "optimizer"}
PHASES = (
    "embedding",
    "attention",
    "attention_core",
    "norms",
    "router",
    "dispatch",
    "experts",
    "shared_experts",
    "dense_mlp",
    "moe_other",
    "lm_head",
    "loss",
    "grads",
    "optimizer",
    "other",
)

# Qualified module names -> phase, first match wins. megatron GPTModel (torch-native or TE spec),
# transformers (Qwen3-MoE, DeepSeek-V3) and torchtitan names.
MODULE_RULES = (
    (r"\.(core_attention|inner_attention|sdpa)$", "attention_core"),
    (r"\.(self_attention|self_attn|attention)$", "attention"),
    (r"norm$", "norms"),
    (r"\.(mlp|moe)\.(router|gate)$", "router"),
    (r"\.(mlp|moe)\.shared_experts?$", "shared_experts"),
    (r"\.(mlp|moe)\.experts$", "experts"),
    (r"\.moe\.reorderer$", "dispatch"),
    (r"(^|\.)(embedding|embed_tokens|tok_embeddings)$", "embedding"),
    (r"(^|\.)(output_layer|lm_head|output)$", "lm_head"),
    (r"\.(mlp|moe|feed_forward)$", "mlp"),
)
DISPATCHER_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


def module_phase(name: str, module: torch.nn.Module) -> str | None:
    for pattern, phase in MODULE_RULES:
        if re.search(pattern, name):
            if phase == "mlp":  # an MoE block (has routed experts) or a dense MLP
                has_experts = any(n in ("experts",) for n, _ in module.named_children())
                return "moe_other" if has_experts else "dense_mlp"
            return phase
    return None


class Scopes:
    """record_function scopes around modules and callables, removable (no trace when not profiled)."""

    def __init__(self):
        self._undo = []

    def module(self, module: torch.nn.Module, phase: str) -> None:
        open_scopes = []

        def enter(_mod, _args):
            scope = record_function(SCOPE + phase)
            scope.__enter__()
            open_scopes.append(scope)

        def leave(_mod, _args, _out):
            if open_scopes:
                open_scopes.pop().__exit__(None, None, None)

        handles = (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))
        self._undo += [h.remove for h in handles]

    def modules(self, root: torch.nn.Module, prefix: str = "") -> int:
        count = 0
        for name, module in root.named_modules(prefix=prefix):
            phase = module_phase(name, module)
            if phase:
                self.module(module, phase)
                count += 1
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None:
                for method in DISPATCHER_METHODS:
                    if hasattr(dispatcher, method):
                        self.attribute(dispatcher, method, "dispatch")
        return count

    def attribute(self, owner, name: str, phase: str) -> None:
        """Wrap `owner.name` (an attribute: method, module-level function or config callable)."""
        original = getattr(owner, name)
        had_own = not isinstance(owner, type) and name in getattr(owner, "__dict__", {})

        @functools.wraps(original)
        def scoped(*args, **kwargs):
            with record_function(SCOPE + phase):
                return original(*args, **kwargs)

        setattr(owner, name, scoped)

        def restore():
            if had_own or isinstance(owner, type) or not hasattr(owner, "__dict__"):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute we added shadowed the class's method

        self._undo.append(restore)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def attribute_events(events, device: bool, ops: dict | None = None) -> dict[str, float]:
    """Microseconds per phase over profiler `events` (torch.autograd.profiler_util.EventList).

    With `ops` (a dict), also adds each op's time under (phase, op name): where a phase's time goes."""
    from torch.autograd import DeviceType

    fwd_phase: dict[tuple[int, int], str] = {}  # (thread, sequence number) -> forward op's phase
    phase_of: dict[int, str | None] = {}  # event id -> phase (None: no scope)
    in_backward: dict[int, bool] = {}
    totals: dict[str, float] = defaultdict(float)
    device_total = 0.0
    # record_function ranges (torch.optim's "Optimizer.step#AdamW.step", ...) also appear on the
    # GPU timeline as annotations spanning all their kernels, and kineto can attach them to the
    # CPU op like kernels: counted, they made the optimizer phase 2-15x the step. They carry the
    # CPU range's name (no kernel is named like a CPU op); not every torch flags them.
    # Not inductor's: it wraps each launch of a compiled Triton kernel in a CPU range named after
    # the kernel (triton_poi_/triton_red_/triton_per_...); those kernels are work, and the range
    # ties them to their phase (the fused cross entropy's were missing from "loss").
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU and not e.name.startswith("triton_")}
    annotations = (
        cpu_names
        | PROFILER_OVERHEAD
        | {e.name for e in events if e.device_type != DeviceType.CPU and e.is_user_annotation}
    )
    for e in sorted(events, key=lambda ev: (ev.time_range.start, -ev.time_range.end)):
        if e.device_type != DeviceType.CPU:
            if e.name not in annotations:
                device_total += e.time_range.elapsed_us()  # a kernel (its op, when known, counts it too)
            continue
        if e.name in PROFILER_OVERHEAD:
            continue
        parent = e.cpu_parent
        phase = phase_of.get(parent.id) if parent is not None else None
        backward = bool(parent is not None and in_backward.get(parent.id))
        if e.name.startswith(SCOPE):
            phase = e.name[len(SCOPE) :]
        elif e.name.startswith(BACKWARD_NODE):
            backward = True
            phase = fwd_phase.get((e.fwd_thread, e.sequence_nr))
            if phase is None and "AccumulateGrad" in e.name:
                phase = "grads"
        elif e.sequence_nr >= 0 and not backward:
            fwd_phase.setdefault((e.thread, e.sequence_nr), phase or "other")
        phase_of[e.id], in_backward[e.id] = phase, backward
        own_kernels = sum(k.duration for k in e.kernels if k.name not in annotations)
        totals[phase or "other"] += own_kernels if device else e.self_cpu_time_total
        if ops is not None and (own_kernels if device else e.self_cpu_time_total):
            key = (phase or "other", e.name)
            ops[key] = ops.get(key, 0.0) + (own_kernels if device else e.self_cpu_time_total)
    if device:  # kernels not tied to any op: by name where known, else "other"
        owned, named = defaultdict(float), defaultdict(float)  # per known name: tied to an op / all
        for e in events:
            if e.device_type == DeviceType.CPU:
                for k in e.kernels:
                    owned[k.name] += k.duration
            elif e.name in KERNEL_PHASES:
                named[e.name] += e.time_range.elapsed_us()
        for name, us in named.items():
            unowned = max(us - owned[name], 0.0)
            totals[KERNEL_PHASES[name]] += unowned
            if ops is not None and unowned:
                key = (KERNEL_PHASES[name], name)
                ops[key] = ops.get(key, 0.0) + unowned
        totals["other"] += max(device_total - sum(totals.values()), 0.0)
    return {p: totals.get(p, 0.0) for p in PHASES if totals.get(p, 0.0) > 0}


def idle_gaps(events, per: float, min_us: float = 10.0, top: int = 10) -> dict:
    """GPU idle time of the profiled steps (gaps of at least `min_us` between kernels), in ms per
    step, in total and by the kernel each gap ended with: what the GPU sat waiting for the host to
    launch. The profiler slows the host, so these overstate the unprofiled gaps."""
    from torch.autograd import DeviceType

    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type != DeviceType.CPU
        and not e.is_user_annotation
        and e.name not in cpu_names
        and e.name not in PROFILER_OVERHEAD
    )
    by_next: dict[str, float] = defaultdict(float)
    busy_until = None
    for start, end, name in kernels:
        if busy_until is not None and start - busy_until >= min_us:
            by_next[name[:80]] += start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    worst = sorted(by_next.items(), key=lambda kv: -kv[1])[:top]
    return dict(
        total_ms=round(sum(by_next.values()) / 1e3 / per, 2),
        by_next_kernel=[[name, round(us / 1e3 / per, 2)] for name, us in worst],
    )


def top_ops(ops: dict, per: float, top: int = 8) -> dict[str, list]:
    """{phase: [[op name, ms per step], ...]} of the `top` costliest ops of each phase."""
    by_phase: dict[str, list] = defaultdict(list)
    for (phase, name), us in sorted(ops.items(), key=lambda kv: -kv[1]):
        if len(by_phase[phase]) < top:
            by_phase[phase].append([name, round(us / 1e3 / per, 3)])
    return dict(by_phase)


def profile_steps(run_step, steps, device: str) -> tuple[dict[str, float], float, dict, dict]:
    """Run `run_step(step)` for each of `steps` under torch.profiler: (ms per step by phase, wall
    seconds per step of those profiled steps, each phase's costliest ops: `top_ops`, the GPU's
    idle gaps: `idle_gaps` with the host's CPU time per phase, empty on CPU)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for step in steps:
            run_step(step)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    ops: dict = {}
    events = prof.events()
    per_phase = attribute_events(events, device=cuda, ops=ops)
    n = max(len(steps), 1)
    gaps = idle_gaps(events, n) if cuda else {}
    if cuda:  # the host's side: CPU time per phase, to set against the kernels it launched
        gaps["host_ms_by_phase"] = {k: round(v / 1e3 / n, 1) for k, v in attribute_events(events, device=False).items()}
    return {k: v / 1e3 / n for k, v in per_phase.items()}, wall / n, top_ops(ops, n), gaps
