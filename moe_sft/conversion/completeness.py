"""The completeness gate: no HF or megatron tensor is silently skipped, in either direction.

* `check_hf_coverage` (conversion, before any model is built): every HF tensor of the checkpoint is
  consumed exactly once by the family's mapping or listed as dropped, and none it needs is missing.
* `check_produced` (conversion and export, before anything is written): every megatron parameter
  is produced by one mapping entry, and every entry names a parameter of the model.
* `check_hf_names` (export, before anything is read): the HF names and shapes written are exactly
  those transformers' own `save_pretrained` writes for this config (`hf_expected`), plus the MTP
  layers transformers' model does not hold.
"""

from __future__ import annotations

import copy
import re

import torch

from moe_sft.conversion import mapping
from moe_sft.conversion.mapping import Entry, MappingError
from moe_sft.models.family import Family
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)


def check_hf_coverage(
    family: Family,
    entries: list[Entry],
    hf_names: set[str],
    hf_cfg=None,
    empty: set[str] = frozenset(),
    carried: set[str] = frozenset(),
) -> None:
    """Every HF tensor is consumed exactly once, carried through (`carried`: a multimodal
    checkpoint's other parts, composite.py) or deliberately dropped, and none is missing.

    With tied embeddings an HF file may still carry `lm_head.weight`: it is the embedding, so it
    counts as dropped for every family. Tensors with no elements (`empty`: transformers builds
    zero-width modules, e.g. DeepSeek-V3's shared experts when n_shared_experts=0) hold no
    weight; the export writes them back (export_plan.py).
    """
    wanted = [n for e in entries for n in e.hf]
    duplicated = {n for n in wanted if wanted.count(n) > 1}
    if duplicated:
        raise MappingError(f"{family.name} mapping consumes these HF tensors twice: {mapping._list(duplicated)}")
    missing = set(wanted) - hf_names
    if missing:
        hint = ""
        if any(n.startswith("lm_head") for n in missing):
            hint = (
                " The checkpoint has no lm_head.weight but config.json says "
                "tie_word_embeddings=false: re-save it with lm_head, or set tie_word_embeddings=true."
            )
        raise MappingError(
            f"HF checkpoint lacks {len(missing)} tensor(s) the {family.name} mapping "
            f"needs: {mapping._list(missing)}.{hint}"
        )
    tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
    dropped = [re.compile(p) for p in family.dropped + ((r"lm_head\.weight",) if tied else ())]
    left = hf_names - set(wanted) - set(empty) - set(carried)
    by_config = family.dropped_for_config(hf_cfg) if family.dropped_for_config and hf_cfg is not None else {}
    for pattern, why in by_config.items():
        matched = {n for n in left if re.fullmatch(pattern, n)}
        if matched:
            log.warning(
                "%s: not converting %d HF tensor(s) (%s): %s", family.name, len(matched), why, mapping._list(matched, 5)
            )
        left -= matched
    unconsumed = {n for n in left if not any(p.fullmatch(n) for p in dropped)}
    if unconsumed:
        raise MappingError(
            f"HF checkpoint has {len(unconsumed)} tensor(s) the {family.name} mapping "
            f"neither loads nor lists as dropped: {mapping._list(unconsumed)}. "
            "Refusing to convert silently incomplete weights."
        )


def check_produced(entries: list[Entry], state: dict) -> None:
    """The completeness gate of `mapping.load_hf_into_state`, run before anything is written."""
    for entry in entries:
        if entry.mcore not in state:
            raise MappingError(f"mapping produces {entry.mcore!r}, which the megatron model lacks")
    unproduced = mapping.model_parameter_names(state) - {e.mcore for e in entries}
    if unproduced:
        raise MappingError(f"no HF tensor produces these megatron parameters: {mapping._list(unproduced)}")


def hf_expected(family, hf_cfg, whole=None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of what transformers' `save_pretrained` writes for this config, from the HF
    model built on the meta device: its state dict without tied copies, with its in-memory
    fusions (transformers 5 stacks experts) reverted to the on-disk names. `whole`: a multimodal
    checkpoint's composite view (composite.CompositeSource): its whole model's tensors."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from moe_sft.runtime import cpu_compat

    cfg = copy.deepcopy(whole.config if whole is not None else hf_cfg)  # building a model writes into its config
    if hasattr(cfg, "quantization_config"):  # exported dequantised
        del cfg.quantization_config
    model_class = whole.spec.hf_model_class if whole is not None else family.hf_model_class
    with cpu_compat.suspended(), torch.device("meta"):
        model = model_class(cfg)
        state = remove_tied_weights_from_state_dict(model.state_dict(), model)
        state = revert_weight_conversion(model, state)
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_save", None) or [])]
    return {k: tuple(v.shape) for k, v in state.items() if not any(p.search(k) for p in ignored)}


def check_hf_names(family, hf_cfg, planned: list[tuple[str, tuple[int, ...]]], whole=None) -> None:
    """The export writes every tensor transformers expects, in its shape; nothing else but the
    MTP layers (`model.layers.{N + k}.*`, or the names the family's MTP rules give them, such as
    Qwen3-Next's `mtp.*`: transformers' model holds none). `whole`: a multimodal checkpoint's
    composite view: its whole model is expected (the carried tensors planned beside the language
    model)."""
    expected = hf_expected(family, hf_cfg, whole)
    written = dict(planned)
    if len(written) != len(planned):
        twice = sorted({n for n, _ in planned if sum(m == n for m, _ in planned) > 1})
        raise MappingError(f"{family.name} export writes these HF tensors twice: {mapping._list(twice)}")
    missing = set(expected) - set(written)
    if missing:
        raise MappingError(
            f"the {family.name} export would not write {len(missing)} tensor(s) "
            f"transformers' model has: {mapping._list(missing)}"
        )
    shapes = [f"{n} {written[n]} (transformers: {s})" for n, s in expected.items() if written[n] != s]
    if shapes:
        raise MappingError(f"{family.name} export shapes differ from transformers': {'; '.join(shapes[:10])}")
    n = hf_cfg.num_hidden_layers
    rename = whole.hf_name if whole is not None else (lambda name: name)
    mtp = tuple(rename(f"model.layers.{n + k}.") for k in range(family.num_mtp_layers(hf_cfg)))
    mtp_names = {rename(h) for e in mapping.expand(family, hf_cfg) if e.mcore.startswith("mtp.") for h in e.hf}
    extra = {
        name for name in set(written) - set(expected) if not name.startswith(mtp or ("\0",)) and name not in mtp_names
    }
    if extra:
        raise MappingError(
            f"the {family.name} export would write {len(extra)} tensor(s) "
            f"transformers' model does not have: {mapping._list(extra)}"
        )
