"""A LoRA/DoRA run's adapters as a PEFT adapter directory of the HF model
(`peft.PeftModel.from_pretrained(base_hf_model, dir)`): adapter_config.json + adapter_model.safetensors.

Where each adapter goes is derived, not written per family: the family's mapping rules say which HF
weights a megatron weight becomes (and how its rows are cut: fused q/k/v interleaved per query
group, gate/up, ...), the HF model built on the meta device says which module or parameter holds
each, and peft itself names the adapter tensors (`get_peft_model` on that model with the LoraConfig
built here, then `get_peft_model_state_dict`'s keys and shapes are filled).

- A linear's parts: B's rows go through the mapping's transform like the weight's rows do (a tag
  per row says which A, hence which HF weight, each row belongs to: the parts that share an A, as
  the Gated DeltaNet's q, k, v in Qwen3.5's in_proj_qkv, make one HF projection); DoRA's
  magnitude likewise.
- Routed experts: transformers 5 keeps them fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate
  first; `down_proj` [E, H, I]), targeted with `LoraConfig.target_parameters` (peft's ParamWrapper:
  lora_A [r*E, in] = A_e per expert, lora_B [out, r*E] with the experts on the last axis). For
  w1_e + s A1_e B1_e (hidden x 2 ffn) that is A_e = A1_eᵀ, B_e = B1_eᵀ; for w2, A_e = A2_eᵀ,
  B_e = B2_eᵀ. A factor shared by a layer's experts is written once per expert (exact).
- Base tensors the run trained (`peft.train_router`): peft's `modules_to_save` on their modules.

Anything peft cannot express (a target transformers' model has no module for, such as an MTP
layer's) is an AdapterExportError naming the field and the fix; the merged export still holds it.
peft is imported here only (inside functions): the trainer needs it when exporting an adapter only.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from moe_sft.conversion import adapter_merge, checksums, mapping, mcore_io
from moe_sft.conversion.hf_source import load_hf_source
from moe_sft.models.transforms import combine
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

CONFIG_FILE = "adapter_config.json"
ADAPTER_DIR = "hf_adapter"  # <trainer.output_dir>/hf_adapter
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class AdapterExportError(mapping.MappingError):
    """The run's adapters have no PEFT equivalent; the message names the field and the fix."""


@dataclasses.dataclass
class _Plan:
    """What the LoraConfig targets, and the values of each target's adapter tensors."""

    modules: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)  # HF module
    params: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)  # HF parameter
    saved: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # HF tensor (modules_to_save)


def _unexpressible(meta: dict, what: str) -> AdapterExportError:
    targets = meta["peft"].get("target_modules")
    return AdapterExportError(
        f"no PEFT adapter can express this run's adapters: {what}. peft.target_modules={targets!r}"
        f"{' with peft.train_router=true' if meta['peft'].get('train_router') else ''}; leave such modules out "
        "of peft.target_modules to get a PEFT adapter. The merged export (trainer output_dir/hf, or "
        "tools/export_mcore_to_hf.py) holds the trained model either way"
    )


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _linear_targets(run, module: str, entry, hf_model, meta: dict) -> dict[str, dict[str, torch.Tensor]]:
    """{HF linear module: {lora_A, lora_B[, magnitude]}} of one adapted megatron linear."""
    factors = run._linear(module)
    rank = next(iter(factors.a.values())).shape[0]
    a_names = list(dict.fromkeys(factors.a_of[p] for p in factors.parts))  # one per HF projection
    width = rank * len(a_names)
    blocks, tags = [], []
    for part in factors.parts:
        i = a_names.index(factors.a_of[part])
        b = factors.b[part]
        block = b.new_zeros(b.shape[0], width)
        block[:, i * rank : (i + 1) * rank] = b
        blocks.append(block.t())
        tags.append(torch.full((1, b.shape[0]), float(i)))
    b_rows = entry.transform.to_hf(combine(blocks, factors.groups).t().contiguous(), run.ctx)
    tag_rows = entry.transform.to_hf(combine(tags, factors.groups).t().contiguous(), run.ctx)
    mags = (
        entry.transform.to_hf(factors.magnitude.unsqueeze(1), run.ctx)
        if factors.magnitude is not None
        else [None] * len(entry.hf)
    )
    out = {}
    for name, b, tag, mag in zip(entry.hf, b_rows, tag_rows, mags):
        parts = tag.unique()
        target = name.removesuffix(".weight")
        layer = _module(hf_model, target)
        if (
            len(parts) != 1
            or b.shape[1] != width
            or not isinstance(layer, torch.nn.Linear)
            or tuple(layer.weight.shape) != (b.shape[0], next(iter(factors.a.values())).shape[1])
        ):
            raise _unexpressible(meta, f"{module} (HF {name}) is no linear module of transformers' model")
        i = int(parts.item())
        a = factors.a[next(p for p in factors.parts if factors.a_of[p] == a_names[i])]
        values = {"lora_A": a, "lora_B": b[:, i * rank : (i + 1) * rank]}
        if mag is not None:
            values["magnitude"] = mag.squeeze(1)
        out[target] = values
    return out


def _expert_param(hf_model, entry, leaf: str, shape: tuple[int, int, int], meta: dict) -> str:
    """The fused HF parameter (`<module>.<name>`) that holds the experts of weight1 or weight2:
    the experts module is the mapping's per-expert HF names up to the expert index, the parameter
    the one of shape [E, out, in] ([E, in, out] where the module says `is_transposed`)."""
    parts = entry.hf[0].split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    # per-expert HF names (…experts.{e}.w1): the module before the expert index; one stacked
    # tensor per layer (gpt-oss's …experts.gate_up_proj): the module that holds it
    prefix = ".".join(parts[: digits[-1]]) if len(digits) >= 2 else ".".join(parts[:-1])
    layer = _module(hf_model, prefix) if prefix else None
    if layer is None:
        raise _unexpressible(meta, f"{entry.mcore} (HF {entry.hf[0]}) has no experts module in transformers' model")
    experts, out, inner = shape
    want = (experts, inner, out) if getattr(layer, "is_transposed", False) else (experts, out, inner)
    found = [n for n, p in layer.named_parameters(recurse=False) if tuple(p.shape) == want]
    if len(found) > 1:  # a square non-gated expert: fc1 is the up projection, fc2 the down one
        found = [n for n in found if ("down" in n) == (leaf == "weight2")]
    if len(found) != 1:
        raise _unexpressible(meta, f"{entry.mcore}: transformers' {prefix} has no one parameter of shape {want}")
    return f"{prefix}.{found[0]}"


def _hf_column_order(entry, ctx: dict, width: int) -> torch.Tensor:
    """megatron's fc1 output columns (gate half, up half) in the order transformers' fused parameter
    holds them: the family's own transform applied to a ramp, as one expert with a hidden size of
    1 (gpt-oss interleaves gate and up columns; the other fused experts keep the gate half first)."""
    ramp = torch.arange(width, dtype=torch.float64).view(1, width)
    pieces = entry.transform.to_hf(ramp, {**ctx, "num_experts": 1})
    return torch.cat([p.reshape(-1) for p in pieces]).long()


def _expert_targets(run, module: str, entries: dict, hf_model, meta: dict) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    experts = run.ctx["num_experts"]
    keys = run.modules[module]
    for leaf in ("weight1", "weight2"):
        if leaf == "weight1":
            a = run._expert_factor(module, "lora_A1", 0, experts)
            halves = [n for n in ("lora_B1_gate", "lora_B1_up", "lora_B1") if n in keys]
            b = torch.cat([run._expert_factor(module, n, 0, experts) for n in halves], dim=-1)
            b = b[..., _hf_column_order(entries[f"{module}.{leaf}"], run.ctx, b.shape[-1])]
        else:
            a = run._expert_factor(module, "lora_A2", 0, experts)
            b = run._expert_factor(module, "lora_B2", 0, experts)
        a, b = a.expand(experts, *a.shape[1:]), b.expand(experts, *b.shape[1:])  # [E, in, r], [E, r, out]
        rank = a.shape[-1]
        name = _expert_param(hf_model, entries[f"{module}.{leaf}"], leaf, (experts, b.shape[2], a.shape[1]), meta)
        out[name] = {
            "lora_A": a.transpose(1, 2).reshape(experts * rank, a.shape[1]),  # (E, r, in)
            "lora_B": b.permute(2, 1, 0).reshape(b.shape[2], rank * experts),  # (out, r, E)
        }
    return out


def _trained_tensors(run, entries: dict, hf_model, meta: dict) -> dict[str, torch.Tensor]:
    """HF tensors of the base tensors the run trained (whole, small: routers)."""
    out = {}
    for key in sorted(run.overrides):
        for entry, value in _per_layer(run, key, entries, meta):
            out.update(_trained_hf_tensors(run, entry, value, hf_model, meta, key))
    return out


def _per_layer(run, key: str, entries: dict, meta: dict) -> list:
    """(mapping entry, value) of each megatron tensor in a trained checkpoint key: megatron saves a
    stack of identical layers under one key with the layer as its first axis
    (`decoder.layers.mlp.router.weight`, Mixtral's and gpt-oss's), mixed stacks layer by layer."""
    value = adapter_merge._read(run.reader, key)
    if key in entries:
        return [(entries[key], value)]
    stacked = "decoder.layers."
    names = [f"{stacked}{i}.{key[len(stacked) :]}" for i in range(value.shape[0])] if key.startswith(stacked) else []
    if not names or any(n not in entries for n in names):
        raise _unexpressible(meta, f"the run trained {key}, which maps to no HF tensor")
    return [(entries[n], value[i]) for i, n in enumerate(names)]


def _trained_hf_tensors(run, entry, value, hf_model, meta: dict, key: str) -> dict[str, torch.Tensor]:
    """The HF tensors of one trained megatron tensor."""
    out = {}
    for i, (name, tensor) in enumerate(zip(entry.hf, entry.transform.to_hf(value, run.ctx))):
        module, _, leaf = name.rpartition(".")
        if i and entry.transform.copies and _module(hf_model, module) is None:
            continue  # a copy kept for MTP layers, which transformers' model does not hold
        if _module(hf_model, module) is None or leaf not in dict(_module(hf_model, module).state_dict()):
            raise _unexpressible(meta, f"the run trained {key} (HF {name}), which is no tensor of transformers' model")
        out[name] = tensor
    return out


def _plan(run, family, hf_cfg, hf_model, meta: dict) -> _Plan:
    entries = {e.mcore: e for e in mapping.expand(family, hf_cfg)}
    plan = _Plan()
    for module, keys in run.modules.items():
        if f"{module}.weight" in entries:
            plan.modules.update(_linear_targets(run, module, entries[f"{module}.weight"], hf_model, meta))
        elif f"{module}.weight1" in entries:
            if any("magnitude" in k for k in keys):
                raise _unexpressible(meta, f"DoRA on the routed experts {module} (peft has none for fused experts)")
            plan.params.update(_expert_targets(run, module, entries, hf_model, meta))
        else:
            raise _unexpressible(meta, f"{module} is no weight of the family's mapping")
    plan.saved = _trained_tensors(run, entries, hf_model, meta)
    return plan


def _lora_config(plan: _Plan, meta: dict):
    from peft import LoraConfig

    saved_modules = _outermost({n.rpartition(".")[0] for n in plan.saved})
    return LoraConfig(
        r=int(meta["peft"]["rank"]),
        lora_alpha=float(meta["peft"]["alpha"]),
        lora_dropout=0.0,  # not recorded by the run, and peft refuses it on target_parameters
        target_modules=sorted(plan.modules),
        target_parameters=sorted(plan.params) or None,
        modules_to_save=saved_modules or None,
        use_dora=meta["peft"]["method"] == "dora",
    )


def _outermost(modules: set[str]) -> list[str]:
    """The modules not inside another one of the set: Gemma 4's trained router holds `scale` and
    `per_expert_scale` itself and its weight in `router.proj`; peft saves `router` whole, and a
    module inside it as well would be wrapped twice."""
    return sorted(m for m in modules if not any(m.startswith(f"{o}.") for o in modules))


def _peft_model(plan: _Plan, new_model, meta: dict):
    """peft's model of the plan's LoraConfig. peft rewrites (for transformers v4 adapters) targets
    whose module is named like a v4 expert projection (gate_proj, up_proj, down_proj on Qwen2/3-MoE,
    DeepSeek-V3, ...) into the fused experts' parameters, dense MLPs and shared experts included, at
    every load. Such linears are targeted as parameters (`<module>.weight`, the same LoRA), which
    peft leaves alone; DoRA has no parameter form in peft, so there it is an error."""
    from peft import get_peft_model

    config = _lora_config(plan, meta)
    try:
        peft_model = get_peft_model(new_model(), config)
    except ValueError as err:  # DoRA on what peft rewrote into parameters
        if meta["peft"]["method"] != "dora":
            raise
        rewritten = sorted(set(plan.modules) - set(config.target_modules or ()))
        raise _unexpressible(
            meta,
            f"DoRA on {rewritten[:4]}: peft {_peft_version()} retargets modules of these names to the fused "
            f"experts (its transformers v4 conversion) and has no DoRA for parameters ({err})",
        ) from err
    rewritten = sorted(set(plan.modules) - set(peft_model.peft_config["default"].target_modules or ()))
    if not rewritten:
        return peft_model
    for module in rewritten:
        plan.params[f"{module}.weight"] = plan.modules.pop(module)
    return get_peft_model(new_model(), _lora_config(plan, meta))


def _peft_version() -> str:
    import peft

    return peft.__version__


def _peft_tensors(plan: _Plan, peft_model, base_tensor) -> dict[str, torch.Tensor]:
    """peft's own state dict of the adapter (names and shapes), filled from the plan; tensors of a
    modules_to_save module the run did not train (DeepSeek-V3's router bias) from the base."""
    from peft import get_peft_model_state_dict

    values = {}
    for name, module in peft_model.named_modules():
        bare = re.sub(r"\.base_layer\b", "", name.removeprefix(PEFT_PREFIX))
        source = plan.params.get(f"{bare}.{module.parameter_name}") if hasattr(module, "parameter_name") else None
        if source is None and not hasattr(module, "parameter_name"):
            source = plan.modules.get(bare) if hasattr(module, "lora_A") else None
        if source is not None:
            values[f"{name}.lora_A.weight"] = source["lora_A"]
            values[f"{name}.lora_B.weight"] = source["lora_B"]
            if "magnitude" in source:
                values[f"{name}.lora_magnitude_vector"] = source["magnitude"]
    values.update({PEFT_PREFIX + n: t for n, t in plan.saved.items()})
    expected = get_peft_model_state_dict(peft_model)
    saved_modules = {n.rpartition(".")[0] for n in plan.saved}
    for key in set(expected) - set(values):
        name = key.removeprefix(PEFT_PREFIX)
        if name.rpartition(".")[0] in saved_modules:
            values[key] = base_tensor(name)
    return _fill(expected, values)


def _fill(expected: dict, values: dict) -> dict[str, torch.Tensor]:
    missing = sorted(set(expected) - set(values))
    extra = sorted(set(values) - set(expected))
    shapes = [f"{k} {tuple(values[k].shape)} (peft: {tuple(v.shape)})" for k, v in expected.items() if k in values]
    shapes = [s for s, (k, v) in zip(shapes, expected.items()) if tuple(values[k].shape) != tuple(v.shape)]
    if missing or extra or shapes:
        raise AdapterExportError(
            f"the adapter does not fit peft's model: missing {missing[:8]}, unexpected {extra[:8]}, shapes {shapes[:8]}"
        )
    return {k: values[k] for k in expected}


@dataclasses.dataclass
class _Prepared:
    """An adapter export checked and planned, nothing written yet."""

    meta: dict
    family: object
    hf_cfg: object
    run: adapter_merge.RunAdapters
    plan: _Plan
    peft_model: object


def _prepare(ckpt_dir: Path, out_dir: Path, overwrite: bool) -> _Prepared:
    meta = mcore_io.read_meta(ckpt_dir)
    if not adapter_merge.is_adapter_run(meta):
        raise AdapterExportError(
            f"{ckpt_dir} is a full-model checkpoint (no peft adapters): there is no adapter to write to "
            f"{out_dir}; export it merged (leave out --adapter-output)"
        )
    base = adapter_merge.base_dir(ckpt_dir, meta)  # the adapters only make sense on their base
    mcore_io.check_not_a_source(
        out_dir, {"--mcore-path": ckpt_dir, "the base checkpoint (moe_sft_meta.json peft_base)": base}
    )
    mcore_io.check_output(out_dir, overwrite, accept=lambda out: _own_adapter_dir(ckpt_dir, out))
    checksums.verify_files(ckpt_dir)  # the base is verified by the merged export, which reads all of it
    family, hf_cfg, whole = load_hf_source(ckpt_dir / mcore_io.HF_SUBDIR)
    if whole is not None:
        raise AdapterExportError(
            f"{ckpt_dir}: the run trained the language model of a {whole.spec.model_type} checkpoint "
            f"({whole.spec.hf_model_class.__name__}); a PEFT adapter for that class is not written yet. "
            "Leave out --adapter-output: the merged export (trainer output_dir/hf, or "
            "tools/export_mcore_to_hf.py) is the whole model with the adapters merged"
        )
    run = adapter_merge.RunAdapters(ckpt_dir, meta, mapping.transform_context(family, hf_cfg))
    plan = _plan(run, family, hf_cfg, _meta_model(family, hf_cfg), meta)
    peft_model = _peft_model(plan, lambda: _meta_model(family, hf_cfg), meta)
    return _Prepared(meta, family, hf_cfg, run, plan, peft_model)


def check_adapter_export(ckpt_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> None:
    """Everything `export_adapter` refuses (a full-model checkpoint, an output it may not replace,
    a damaged checkpoint, adapters peft cannot express), checked without writing anything: the
    export tool runs it before it writes the merged model."""
    _prepare(Path(ckpt_dir), Path(out_dir), overwrite)


def export_adapter(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", overwrite: bool = False) -> Path:
    """Write the PEFT adapter directory of a LoRA/DoRA run's checkpoint (atomically)."""
    from safetensors.torch import save_file

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    p = _prepare(ckpt_dir, out_dir, overwrite)
    base_tensor = _base_tensors(adapter_merge.base_dir(ckpt_dir, p.meta), p.family, p.hf_cfg, p.run.ctx)
    tensors = _peft_tensors(p.plan, p.peft_model, base_tensor)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    config = _lora_config(p.plan, p.meta)  # as planned: peft rewrites the one it is given, and again at load
    tmp = mcore_io.staging_dir(out_dir)
    tmp.mkdir(parents=True)
    try:
        (tmp / mcore_io.EXPORT_STAMP).write_text(str(ckpt_dir.resolve()))
        config.base_model_name_or_path = p.meta.get("source")  # get_peft_model set the meta model's
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / mcore_io.EXPORT_STAMP).unlink()
        mcore_io.commit_dir(tmp, out_dir)
    except BaseException:
        mcore_io.discard_staging(tmp)
        raise
    return out_dir


def _meta_model(family, hf_cfg):
    with torch.device("meta"):
        return family.hf_model_class(hf_cfg)


def _base_tensors(base: Path, family, hf_cfg, ctx: dict):
    """HF tensor name -> its value in the base checkpoint (whole megatron tensor read, transformed)."""
    from moe_sft.conversion.dcp_reader import DistCheckpointReader

    entries = {n: e for e in mapping.expand(family, hf_cfg) for n in e.hf}
    reader = DistCheckpointReader(base)

    def tensor(name: str) -> torch.Tensor:
        entry = entries.get(name)
        if entry is None or entry.mcore not in reader.tensors():
            raise AdapterExportError(f"{name}: no tensor of the base checkpoint {base} gives it")
        return entry.transform.to_hf(adapter_merge._read(reader, entry.mcore), ctx)[entry.hf.index(name)]

    return tensor


def _own_adapter_dir(ckpt_dir: Path, out_dir: Path) -> bool:
    """`out_dir` is the adapter export of the run that saved `ckpt_dir` (the trainer replaces its
    own earlier one, as export.py's `_own_export_dir` for `<output_dir>/hf`); a user's file there
    stops it (OutputDirError) rather than being deleted with the rest."""
    ckpt = ckpt_dir.resolve()
    if not (ckpt.parent.name == "checkpoints" and out_dir.resolve() == ckpt.parent.parent / ADAPTER_DIR):
        return False
    theirs = mcore_io.user_entries(out_dir, lambda name: name in (CONFIG_FILE, WEIGHTS_FILE))
    if theirs:
        raise mcore_io.OutputDirError(mcore_io.user_entries_message(out_dir, theirs, "PEFT adapter export"))
    return True


def export_adapter_if_expressible(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "bf16") -> str | None:
    """`export_adapter`, or why a PEFT adapter cannot hold this run's adapters (nothing written):
    the end-of-training export writes the merged model either way and logs the reason."""
    try:
        export_adapter(ckpt_dir, out_dir, dtype)
    except AdapterExportError as err:
        log.warning(f"PEFT adapter export skipped: {err}")
        return str(err)
    return None
