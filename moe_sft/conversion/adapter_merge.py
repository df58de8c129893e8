"""Merging a LoRA/DoRA run's adapters into its frozen base, one export unit at a time.

A LoRA run's checkpoint holds only its trainable entries (moe_sft/peft/state.py): the adapter
factors under global keys `<module>.adapter.<factor>` (whole, unsharded), any base tensor left
trainable (the routers with `peft.train_router`), and the optimizer. The base is the converted
checkpoint named in its meta (`peft_base`, moe_sft/peft/run_meta.py). The streaming exporter plans
the export on the base and reads each unit (a run of experts, of rows, or a whole tensor) from it;
`RunAdapters.merge` turns the unit into its merged value before the family's transform makes the
HF tensors. The math is the adapters' own, in fp32 (the export casts to its dtype afterwards):

- linear: W' = W + s * B @ A, parts combined into the fused rows as `LinearAdapter.delta_weight`;
- DoRA: W' = m * (W + s B A) / |W + s B A|, |.| the norm of each output row (row-local, so a run
  of rows merges alone);
- experts: w1_e' = w1_e + s * A1_e @ [B1_gate_e | B1_up_e], w2_e' = w2_e + s * A2_e @ B2_e, in
  GroupedMLP's per-expert blocks (hidden x 2 ffn, ffn x hidden); a factor shared by a layer's
  experts has a leading dim of 1.

It sits beside the exporter, below peft/: the export reads any run's checkpoint, and the PEFT
adapter export (peft/hf_adapter.py) reads the same factors through it.

Memory: one module's factors (an expert factor only for the experts of the unit) beside the unit.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import torch

from moe_sft.conversion import mcore_io
from moe_sft.conversion.dcp_reader import DistCheckpointReader, IncompleteCheckpointError
from moe_sft.conversion.export_plan import NOT_MODEL_STATE
from moe_sft.conversion.mapping import MappingError
from moe_sft.models.transforms import combine

ADAPTER = ".adapter."
# The parts of a fused linear, in the order of its rows (install.py's `_parts`); "" = not fused.
PART_ORDER = ("q", "k", "v", "z", "b", "a", "gate", "up", "")
QKV_SUFFIX = "self_attention.linear_qkv"


class AdapterRunError(IncompleteCheckpointError):
    """A LoRA run's checkpoint cannot be merged: its base is missing or another, or its entries do
    not fit the model."""


def is_adapter_run(meta: dict) -> bool:
    """The checkpoint holds adapters (and the trainable rest) of a LoRA/DoRA run, not a model."""
    return bool(meta.get("peft"))


def base_dir(ckpt_dir: Path, meta: dict) -> Path:
    """The converted base a LoRA run was trained on, checked to be the same one (its fingerprint)."""
    base = meta.get("peft_base") or {}
    path = Path(base.get("path", ""))
    if not base.get("path") or not (path / mcore_io.META_FILE).is_file():
        raise AdapterRunError(
            f"{ckpt_dir}: a {meta['peft'].get('method')} run's checkpoint holds the adapters only; its base "
            f"(moe_sft_meta.json peft_base.path={base.get('path')!r}) is not a moe-sft checkpoint any more. "
            "Put the converted base the run was trained on (model.mcore_path) back at that path"
        )
    if mcore_io.base_identity(path) != base.get("id"):
        raise AdapterRunError(
            f"{ckpt_dir}: the base at peft_base.path={str(path)!r} is not the one the adapters were trained on "
            f"(fingerprint {mcore_io.base_identity(path)}, run: {base.get('id')}); restore that conversion there"
        )
    return path


def _read(reader: DistCheckpointReader, key: str, first: int = 0, count: int | None = None) -> torch.Tensor:
    """Global tensor `key` (rows [first, first + count) of its first dim if count), in fp32."""
    md = reader.tensors()[key]
    shape = list(md.size)
    if count is not None:
        shape[0] = count
    dest = torch.empty(shape, dtype=md.properties.dtype)
    reader.read_into(key, (first,) + (0,) * (len(shape) - 1), dest)
    return dest.float()


@dataclasses.dataclass
class LinearFactors:
    """One linear's adapter: A [r, in] and B [out_part, r] per part, DoRA's magnitude [out].
    Parts of one transformers projection share their A (`a_of`: part -> the A's name)."""

    parts: list[str]
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    magnitude: torch.Tensor | None
    scale: float
    groups: int
    a_of: dict[str, str]

    def delta(self, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of s * B @ A, in the fused weight's row layout."""
        if len(self.parts) == 1:
            part = self.parts[0]
            return self.b[part][first:stop] @ self.a[part] * self.scale
        rows = [(self.b[p] @ self.a[p]).t() for p in self.parts]
        return combine(rows, self.groups).t()[first:stop] * self.scale

    def merged(self, weight: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        merged = weight.float() + self.delta(first, stop)
        if self.magnitude is None:
            return merged
        norm = merged.pow(2).sum(dim=1).sqrt()
        return merged * (self.magnitude[first:stop] / norm).unsqueeze(1)


class RunAdapters:
    """The trainable entries of a LoRA run's checkpoint, by the base parameter they change."""

    def __init__(self, ckpt_dir: Path, meta: dict, ctx: dict):
        self.reader = DistCheckpointReader(ckpt_dir)
        self.peft = meta["peft"]
        self.scale = float(self.peft["alpha"]) / int(self.peft["rank"])
        self.ctx = ctx
        self.modules: dict[str, dict[str, str]] = defaultdict(dict)  # module -> {factor: key}
        self.overrides: set[str] = set()  # base tensors the run trained (routers)
        for key in self.reader.tensors():
            if NOT_MODEL_STATE.fullmatch(key):
                continue
            if ADAPTER in key:
                module, factor = key.split(ADAPTER, 1)
                self.modules[module][factor] = key
            else:
                self.overrides.add(key)
        self.used: set[str] = set()
        self._cached: tuple[str, LinearFactors] | None = None

    # ------------------------------------------------------------------ gates
    def reader_for(self, param, base_reader: DistCheckpointReader) -> DistCheckpointReader:
        """The run's reader for a parameter the run trained itself, else the base's."""
        keys = {p.key for p in param.pieces}
        trained = keys & self.overrides
        if not trained:
            return base_reader
        if trained != keys:
            raise AdapterRunError(
                f"{param.entry.mcore}: the run's checkpoint holds {sorted(trained)} of {sorted(keys)}"
            )
        base = base_reader.tensors()
        run = self.reader.tensors()
        differ = [k for k in keys if tuple(run[k].size) != tuple(base[k].size)]
        if differ:
            raise AdapterRunError(f"{self.reader.path}: {differ} have another shape than the base's")
        self.used |= keys
        if any(run[k].properties.dtype != base[k].properties.dtype for k in keys):
            return _CastingReader(self.reader)  # e.g. an fp32 base trained in bf16
        return self.reader

    def check_consumed(self, params) -> None:
        """Every adapter sits beside a parameter the export writes; every trained tensor is one."""
        names = {p.entry.mcore for p in params}
        orphans = [m for m in self.modules if not any(f"{m}.{w}" in names for w in ("weight", "weight1", "weight2"))]
        unread = sorted(self.overrides - self.used)
        if orphans or unread:
            raise MappingError(
                f"{self.reader.path}: the run's checkpoint holds entries no exported parameter takes: adapters of "
                f"{orphans[:8]}, tensors {unread[:8]}. Refusing to export silently incomplete weights."
            )

    # ------------------------------------------------------------------ merging
    def adapted(self, mcore: str) -> str | None:
        module, _, leaf = mcore.rpartition(".")
        return module if module in self.modules and leaf in ("weight", "weight1", "weight2") else None

    def merge(self, param, first: int, stop: int, unit: torch.Tensor) -> torch.Tensor:
        """The merged value (fp32) of slices [first, stop) of an adapted parameter."""
        module = self.adapted(param.entry.mcore)
        leaf = param.entry.mcore.rpartition(".")[2]
        if leaf == "weight":
            factors = self._linear(module)
            lo, hi = (first, stop) if param.kind == "rows" else (0, unit.shape[0])
            return factors.merged(unit.reshape(hi - lo, -1), lo, hi).reshape(unit.shape)
        if param.kind == "whole":
            first, stop = 0, self.ctx["num_experts"]
        delta = self._expert_delta(module, leaf, first, stop)
        return (unit.float().reshape(delta.shape) + delta).reshape(unit.shape)

    def _linear(self, module: str) -> LinearFactors:
        if self._cached is not None and self._cached[0] == module:
            return self._cached[1]
        keys = self.modules[module]
        name = lambda kind, p: f"{kind}_{p}" if p else kind  # noqa: E731
        parts = [p for p in PART_ORDER if name("lora_B", p) in keys]
        a_of, run = {}, []  # an A is named by the parts it serves, consecutive in row order
        for part in parts:
            run.append(part)
            if name("lora_A", "".join(run)) in keys:
                a_of.update({p: "".join(run) for p in run})
                run = []
        if run or not parts:
            raise AdapterRunError(f"{self.reader.path}: {module}'s adapter entries {sorted(keys)} do not fit a linear")
        groups = _query_groups(self.ctx, module) if module.endswith(QKV_SUFFIX) else 1
        a = {n: _read(self.reader, keys[name("lora_A", n)]) for n in set(a_of.values())}
        if "lora_magnitude" in keys:
            magnitude = _read(self.reader, keys["lora_magnitude"])
        elif name("lora_magnitude", parts[0]) in keys:  # one per part (install.py: concatenated parts)
            magnitude = combine([_read(self.reader, keys[name("lora_magnitude", p)])[None] for p in parts], groups)[0]
        else:
            magnitude = None
        factors = LinearFactors(
            parts,
            {p: a[a_of[p]] for p in parts},
            {p: _read(self.reader, keys[name("lora_B", p)]) for p in parts},
            magnitude,
            self.scale,
            groups,
            a_of,
        )
        self._cached = (module, factors)
        return factors

    def _expert_factor(self, module: str, factor: str, first: int, stop: int) -> torch.Tensor:
        key = self.modules[module][factor]
        if self.reader.tensors()[key].size[0] == 1:  # shared by the layer's experts
            return _read(self.reader, key)
        return _read(self.reader, key, first, stop - first)

    def _expert_delta(self, module: str, leaf: str, first: int, stop: int) -> torch.Tensor:
        """s * A @ B for experts [first, stop): [n, hidden, 2 ffn] (weight1) or [n, ffn, hidden]."""
        keys = self.modules[module]
        if leaf == "weight1":
            a = self._expert_factor(module, "lora_A1", first, stop)
            halves = [n for n in ("lora_B1_gate", "lora_B1_up", "lora_B1") if n in keys]
            b = torch.cat([self._expert_factor(module, n, first, stop) for n in halves], dim=-1)
        else:
            a = self._expert_factor(module, "lora_A2", first, stop)
            b = self._expert_factor(module, "lora_B2", first, stop)
        delta = a @ b * self.scale
        return delta.expand(stop - first, *delta.shape[1:])


class _CastingReader:
    """A run checkpoint's reader whose tensors are stored in another dtype than the base's (the
    export plan is the base's): each box is read in the stored dtype and copied into `dest`."""

    def __init__(self, reader: DistCheckpointReader):
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read_into(self, key: str, offsets, dest: torch.Tensor) -> None:
        stored = self._reader.tensors()[key].properties.dtype
        if stored == dest.dtype:
            self._reader.read_into(key, offsets, dest)
            return
        box = torch.empty(dest.shape, dtype=stored)
        self._reader.read_into(key, offsets, box)
        dest.copy_(box)


def _query_groups(ctx: dict, module: str) -> int:
    """linear_qkv's query groups: the layer's own where they differ per layer (the family's
    transform context `query_groups_per_layer`, Gemma 4's full layers), else the model's."""
    per_layer = ctx.get("query_groups_per_layer")
    head, _, rest = module.partition("decoder.layers.")
    index = rest.split(".", 1)[0]
    if per_layer and not head and index.isdigit():
        return per_layer[int(index)]
    return ctx["num_query_groups"]
