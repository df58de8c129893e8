"""Which rank holds what: parallel coordinates and the layers / experts of every rank.

Pure Python replicas of megatron-core 0.16.1, so a layout can be inspected for any world size on a
laptop, without torch.distributed:

* rank coordinates: `parallel_state.RankGenerator` with the default order "tp-cp-ep-dp-pp"
  (TP fastest, PP slowest). Attention ranks: rank = tp + TP*(cp + CP*(dp + DP*pp)); expert ranks
  (their own generator, same PP groups): rank = etp + ETP*(ep + EP*(edp + EDP*pp)). So the EP x ETP
  groups are formed inside one pipeline stage's TP*CP*DP ranks, which is why ETP*EP must divide
  them (world % (ETP*EP*PP) == 0).
* layers of each (pipeline stage, virtual stage): `get_transformer_layer_offset` and
  `get_num_layers_to_build`, including uneven first/last stages with and without VPP.
* MTP layers live on the last virtual stage of the last pipeline stage (get_mtp_num_layers_to_build).

tests/cpu/test_plan.py checks each function against megatron's own.
"""

from __future__ import annotations

from moe_sft.config.layout import Layout

__all__ = ["Layout", "layout_from_config"]


def layout_from_config(cfg, world: int, topk: int = 0) -> Layout:
    """The recipe's layout at `world` GPUs (the planner plans for CUDA)."""
    return Layout.from_config(cfg, world, topk=topk, device="cuda")


# ----------------------------------------------------------------------------- layers


def chunk_layers(num_layers: int, lay: Layout, pp_rank: int, vp_stage: int) -> range:
    """Decoder layers (0-based, global) of pipeline rank `pp_rank`, virtual stage `vp_stage`."""
    if lay.pp == 1:
        return range(num_layers)
    vp = lay.vp
    if lay.first is None and lay.last is None:
        per_rank = num_layers // lay.pp
        per_chunk = per_rank // vp
        offset = vp_stage * (num_layers // vp) + pp_rank * per_chunk if lay.vpp else pp_rank * per_rank
        return range(offset, offset + per_chunk)
    first, last = lay.first or 0, lay.last or 0
    middle_stages = lay.pp - (lay.first is not None) - (lay.last is not None)
    middle = num_layers - first - last
    per_middle = middle // middle_stages if middle_stages else 0
    if pp_rank == 0 and lay.first is not None:
        count = first
    elif pp_rank == lay.pp - 1 and lay.last is not None:
        count = last
    else:
        count = per_middle
    count //= vp
    middle_rank = pp_rank if lay.first is None else pp_rank - 1
    if lay.vpp:
        total_chunk = first // vp + middle // vp + last // vp
        offset = vp_stage * total_chunk + (
            0 if pp_rank == 0 else first // vp + middle_rank * ((middle // vp) // middle_stages)
        )
    else:
        offset = 0 if pp_rank == 0 else middle_rank * per_middle + first
    return range(offset, offset + count)


def stage_layers(num_layers: int, lay: Layout, pp_rank: int) -> list[range]:
    """The layer ranges of every virtual stage of one pipeline rank."""
    return [chunk_layers(num_layers, lay, pp_rank, v) for v in range(lay.vp)]


def is_first_chunk(lay: Layout, pp_rank: int, vp_stage: int) -> bool:
    return pp_rank == 0 and vp_stage == 0


def is_last_chunk(lay: Layout, pp_rank: int, vp_stage: int) -> bool:
    return pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1


# ----------------------------------------------------------------------------- ranks


def _digits(value: int, sizes: list[int]) -> list[int]:
    out = []
    for size in sizes:
        out.append(value % size)
        value //= size
    return out


def rank_coords(rank: int, lay: Layout) -> dict[str, int]:
    """Coordinates of a global rank in megatron's default order tp-cp-ep-dp-pp."""
    tp, cp, dp, pp = _digits(rank, [lay.tp, lay.cp, lay.dp, lay.pp])
    etp, ep, edp, epp = _digits(rank, [lay.etp, lay.ep, lay.edp, lay.pp])
    assert epp == pp, "expert and attention pipeline groups differ"  # megatron asserts the same
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, edp=edp)


def _ranges(idx: list[int]) -> str:
    """'0-3,8' for sorted ints."""
    if not idx:
        return "-"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def rank_roles(shape, lay: Layout, gpus_per_node: int = 8) -> list[str]:
    """One line per global rank: coordinates, layers per virtual stage, experts, extra modules."""
    lines = [f"{'rank':>5} {'node':>4}  tp pp cp dp | ep etp edp | layers (per virtual stage) | experts | holds"]
    experts_per_rank = shape.num_experts // lay.ep if shape.num_experts else 0
    for rank in range(lay.world):
        c = rank_coords(rank, lay)
        chunks = stage_layers(shape.num_layers, lay, c["pp"])
        layers = " ".join(f"[{_ranges(list(r))}]" for r in chunks)
        extra = []
        if c["pp"] == 0:
            extra.append("embedding")
        if c["pp"] == lay.pp - 1:
            extra.append("final norm+lm head+loss")
            if shape.mtp_layers:
                extra.append(f"MTP x{shape.mtp_layers}")
        moe_here = any(shape.moe_layers[i] for r in chunks for i in r) or (shape.mtp_layers and c["pp"] == lay.pp - 1)
        experts = "-"
        if experts_per_rank and moe_here:
            lo = c["ep"] * experts_per_rank
            experts = f"{lo}-{lo + experts_per_rank - 1}" + (f" (1/{lay.etp} of each)" if lay.etp > 1 else "")
        lines.append(
            f"{rank:>5} {rank // max(gpus_per_node, 1):>4}  {c['tp']:>2} {c['pp']:>2} {c['cp']:>2} {c['dp']:>2} | {c['ep']:>2} "
            f"{c['etp']:>3} {c['edp']:>3} | {layers} | {experts} | {', '.join(extra) or '-'}"
        )
    return lines
