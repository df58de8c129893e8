"""The generic engine behind every family's mapping table, with the completeness gate.

`expand()` turns a family's declarative rules into concrete (mcore name, HF names, transform)
entries for this config. Loading checks that every HF tensor is consumed exactly once or matches
the family's DROPPED list, and that every megatron parameter is produced: a missing
`e_score_correction_bias`, MTP layer or `lm_head` is an error listing the names, never a skip.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moe_sft.models.builder import padded_vocab_size
from moe_sft.models.common import LAYER as HF_LAYER
from moe_sft.models.family import Family, Rule
from moe_sft.models.hf_config import num_experts
from moe_sft.models.transforms import CopiesDifferError, Transform, keeping


class MappingError(ValueError):
    """The checkpoint and the family's mapping table disagree; the message lists the names."""


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    transform: Transform


def transform_context(family: Family, hf_cfg) -> dict:
    kw = family.transformer_config_kwargs(hf_cfg)
    ctx = dict(
        num_query_groups=kw["num_query_groups"],
        head_dim=kw["kv_channels"],
        num_experts=num_experts(hf_cfg),
        vocab_size=hf_cfg.vocab_size,
        padded_vocab_size=padded_vocab_size(hf_cfg.vocab_size),
        num_mtp_layers=family.num_mtp_layers(hf_cfg),
    )
    if family.transform_context is not None:
        ctx.update(family.transform_context(hf_cfg))
    return ctx


DECODER_LAYER = "decoder.layers.{layer}."
MTP_LAYER = "mtp.layers.{mtp}."


def _layer_ids(family: Family, hf_cfg, rule: Rule) -> list[dict]:
    """The placeholder values a rule expands over: decoder layers, then MTP layers.

    HF numbers MTP layers after the decoder (`model.layers.{N + k}`, or under the family's
    `mtp_layer_hf_prefix`); megatron keeps them in `mtp.layers.{k}`, whose `transformer_layer` is a
    full decoder layer mapped by the same rules.
    """
    n = hf_cfg.num_hidden_layers
    mtp = range(family.num_mtp_layers(hf_cfg))
    if rule.layers == "none":
        return [{}]
    if rule.layers == "mtp":
        return [{"mtp": k, "layer": n + k} for k in mtp]
    if rule.layers in ("linear_attention", "full_attention"):  # hybrid models: by the layer's mixer
        linear = family.is_linear_attention_layer
        # MTP layers (i >= n) run full attention
        wanted = lambda i: (i < n and linear(hf_cfg, i)) == (rule.layers == "linear_attention")  # noqa: E731
    else:
        wanted = lambda i: rule.layers == "all" or family.is_moe_layer(hf_cfg, i) == (rule.layers == "moe")  # noqa: E731
    return [{"layer": i} for i in range(n) if wanted(i)] + [{"mtp": k, "layer": n + k} for k in mtp if wanted(n + k)]


def expand(family: Family, hf_cfg) -> list[Entry]:
    experts = range(num_experts(hf_cfg))
    entries = []
    for rule in family.rules(hf_cfg):
        for fmt in _layer_ids(family, hf_cfg, rule):
            mcore = rule.mcore
            hf = rule.hf
            if "mtp" in fmt and rule.layers != "mtp":  # a decoder rule applied to an MTP layer
                mcore = mcore.replace(DECODER_LAYER, MTP_LAYER + "transformer_layer.")
                if family.mtp_layer_hf_prefix:
                    hf = tuple(n.replace(HF_LAYER, family.mtp_layer_hf_prefix) for n in hf)
            hf_names = []
            if any("{expert}" in n for n in hf):
                for e in experts:
                    hf_names += [n.format(expert=e, **fmt) for n in hf]
            else:
                hf_names = [n.format(**fmt) for n in hf]
            entries.append(Entry(mcore.format(**fmt), tuple(hf_names), rule.transform))
    return entries


def drop_absent_mtp(family: Family, hf_cfg, hf_names: set[str], rename=lambda name: name) -> dict | None:
    """Set the config's MTP layer count to 0 when the checkpoint holds none of those layers' tensors;
    returns {config field: the count it declared}, or None when nothing changed.

    transformers' models have no MTP module, so a checkpoint they saved declares MTP layers (the
    config class's default, e.g. DeepSeek-V3's `num_nextn_predict_layers=1`) without their tensors.
    Some of them but not all is left to the completeness gate, which names the missing ones.
    `rename`: the HF names as the checkpoint spells them (composite.CompositeSource.hf_name).
    """
    declared, field = family.num_mtp_layers(hf_cfg), family.mtp_config_field
    if not declared or field is None:
        return None
    without = copy.deepcopy(hf_cfg)
    setattr(without, field, 0)
    names = lambda cfg: {rename(n) for e in expand(family, cfg) for n in e.hf}  # noqa: E731
    if (names(hf_cfg) - names(without)) & set(hf_names):
        return None
    setattr(hf_cfg, field, 0)
    return {field: declared}


def without_copies(entries: list[Entry], absent) -> list[Entry]:
    """The entries with the HF names in `absent` left out, where they are copies (`Transform.copies`)
    that hold no information: GLM-4.6's MTP layer stores no copy of the embedding and LM head,
    which DeepSeek-V3 and GLM-4.5 carry. Absent names that are not such copies stay in, for the
    completeness gate to name."""
    absent, out = set(absent), []
    for entry in entries:
        kept = [i for i, n in enumerate(entry.hf) if i == 0 or n not in absent]
        if entry.transform.copies and len(kept) < len(entry.hf):
            entry = Entry(entry.mcore, tuple(entry.hf[i] for i in kept), keeping(entry.transform, kept))
        out.append(entry)
    return out


def absent_copies(entries: list[Entry], hf_names: set[str]) -> list[str]:
    """The copies (`without_copies`) the entries name that `hf_names`, a checkpoint's, lacks."""
    return sorted(n for e in entries if e.transform.copies for n in e.hf[1:] if n not in hf_names)


def _list(names, limit=20) -> str:
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def model_parameter_names(state_dict: dict) -> set[str]:
    return {k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def load_hf_into_state(entries: list[Entry], get_hf: Callable[[str], torch.Tensor], ctx: dict, target: dict) -> None:
    """Fill `target` (name → tensor, a module's state_dict) from HF tensors fetched one at a time."""
    produced = set()
    for entry in entries:
        if entry.mcore not in target:
            raise MappingError(f"mapping produces {entry.mcore!r}, which the megatron model lacks")
        try:
            value = entry.transform.from_hf([get_hf(n) for n in entry.hf], ctx)
        except CopiesDifferError as err:
            raise MappingError(
                f"{entry.mcore}: HF tensors {list(entry.hf)} should be copies of one "
                f"tensor but are not ({err}); moe-sft keeps one, so converting would "
                "lose the others"
            ) from err
        dest = target[entry.mcore]
        if tuple(value.shape) != tuple(dest.shape):
            raise MappingError(
                f"{entry.mcore}: HF tensors {list(entry.hf)[:3]} give shape "
                f"{tuple(value.shape)} via {entry.transform.name}, model expects "
                f"{tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(value)
        produced.add(entry.mcore)
    unproduced = model_parameter_names(target) - produced
    if unproduced:
        raise MappingError(f"no HF tensor produces these megatron parameters: {_list(unproduced)}")


def state_to_hf(entries: list[Entry], state: dict, ctx: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from a megatron state_dict, one entry at a time."""
    missing = [e.mcore for e in entries if e.mcore not in state]
    if missing:
        raise MappingError(f"megatron checkpoint lacks {_list(missing)}")
    for entry in entries:
        tensors = entry.transform.to_hf(state[entry.mcore], ctx)
        if len(tensors) != len(entry.hf):
            raise MappingError(
                f"{entry.transform.name} gave {len(tensors)} tensors for {len(entry.hf)} HF names ({entry.mcore})"
            )
        yield from zip(entry.hf, tensors)
