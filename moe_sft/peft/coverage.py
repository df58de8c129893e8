"""The startup line that says where the adapters went, per module kind (issue 46 item 4):

    peft coverage: LoRA r16 on: attention q/k/v/o 48/48 layers, routed experts fc1/fc2 48/48 layers
    x 128 experts; not targeted: shared expert fc1/fc2 (48 layers)

Counted over the whole model, not this rank's stage: each (kind, global layer) is marked present
and targeted on the ranks that hold it and max-reduced over the world, so pipeline stages add up
and TP / DP / EP replicas count once. A kind the model lacks is not named; one it has that no
target reaches is named under "not targeted" (adapters that never reach the experts are the
field's recurring silent failure)."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from moe_sft.peft import targets

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# (group, member's short name, module suffix after decoder.layers.{i}.), in log order; a group's
# members that exist in the model are listed, joined by "/"
KINDS: tuple[tuple[str, str, str], ...] = (
    ("attention", "q/k/v", "self_attention.linear_qkv"),
    ("attention", "q", "self_attention.linear_q_proj"),  # MLA without a q LoRA
    ("attention", "q_a", "self_attention.linear_q_down_proj"),  # MLA: transformers' q_a_proj
    ("attention", "q_b", "self_attention.linear_q_up_proj"),
    ("attention", "kv_a", "self_attention.linear_kv_down_proj"),  # MLA: kv_a_proj_with_mqa
    ("attention", "kv_b", "self_attention.linear_kv_up_proj"),
    ("attention", "o", "self_attention.linear_proj"),
    ("linear attention (Gated DeltaNet)", "in_proj", "self_attention.in_proj"),
    ("linear attention (Gated DeltaNet)", "out_proj", "self_attention.out_proj"),
    ("dense MLP", "fc1", "mlp.linear_fc1"),
    ("dense MLP", "fc2", "mlp.linear_fc2"),
    ("shared expert", "fc1", "mlp.shared_experts.linear_fc1"),
    ("shared expert", "fc2", "mlp.shared_experts.linear_fc2"),
    ("routed experts", "fc1/fc2", "mlp.experts"),
)
_INDEX = {suffix: i for i, (_, _, suffix) in enumerate(KINDS)}
EXPERTS = "routed experts"


def _marks(chunks, targeted: set[str], num_layers: int, device: str) -> torch.Tensor:
    """[2, kinds + 1, layers]: present / targeted per kind (the last row: any other module, e.g.
    an MTP layer's, counted in layer 0) and global layer, max-reduced over the world."""
    marks = torch.zeros(2, len(KINDS) + 1, max(num_layers, 1), device=device)
    for chunk in chunks:
        for global_name, _, _ in targets.adaptable_modules(chunk):
            match = _LAYER.match(global_name)
            kind, layer = (_INDEX.get(match.group(2), len(KINDS)), int(match.group(1))) if match else (len(KINDS), 0)
            marks[0, kind, layer] = 1
            if global_name in targeted:
                marks[1, kind, layer] = 1
    if dist.is_initialized():
        dist.all_reduce(marks, op=dist.ReduceOp.MAX)
    return marks


def _layers(n: int) -> str:
    return f"{n} layer" + ("s" if n != 1 else "")


def coverage_line(chunks, targeted: set[str], cfg, tconfig, device: str) -> str:
    """`targeted`: the global names of the modules that got an adapter on this rank."""
    marks = _marks(chunks, targeted, tconfig.num_layers, device)
    present, hit = marks[0].sum(1).int().tolist(), marks[1].sum(1).int().tolist()
    groups: dict[str, list[tuple[str, int, int]]] = {}
    for (group, short, _), n_present, n_hit in zip(KINDS, present, hit):
        if n_present:
            groups.setdefault(group, []).append((short, n_hit, n_present))
    on, off = [], []
    for group, members in groups.items():
        names = "/".join(m[0] for m in members)
        experts = f" x {tconfig.num_moe_experts} experts" if group == EXPERTS else ""
        if not any(m[1] for m in members):
            off.append(f"{group} {names} ({_layers(members[0][2])})")
        elif len({(m[1], m[2]) for m in members}) == 1:
            on.append(f"{group} {names} {members[0][1]}/{_layers(members[0][2])}{experts}")
        else:  # some members or layers only: each on its own
            on.append(f"{group} " + ", ".join(f"{s} {n}/{_layers(t)}" for s, n, t in members) + experts)
    if hit[-1]:
        on.append("modules outside the decoder layers (MTP)")
    method = {"lora": "LoRA", "dora": "DoRA"}.get(cfg.method, cfg.method)
    text = f"peft coverage: {method} r{cfg.rank} on: " + (", ".join(on) or "nothing")
    return text + (f"; not targeted: {', '.join(off)}" if off else "")
