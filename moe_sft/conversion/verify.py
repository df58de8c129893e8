"""Parity of a converted checkpoint with transformers' own modeling code (fp32, CPU), two ways.

`verify`: logits of HF's whole model against ours on a few token sequences. Both whole models are
in memory, so it is for models that fit (the tiny ones of the tests, a 30B on a large host).

`verify_layers`: decoder layers one at a time, at any model size. For each chosen layer, HF's
decoder-layer module (the class transformers' model instantiates at that index) gets that
layer's tensors from the HF checkpoint, loaded through transformers' own conversion (so fused
in-memory experts are made as `from_pretrained` makes them); megatron's layer (the one the model
builder makes at that index) gets its tensors from the converted dist checkpoint. Both run on
the same random hidden states: packed documents for megatron, each document alone for HF, with
each side's own rotary embedding. Only the chosen layer is ever materialised: both whole models
exist on the meta device only (their structure, no storage), and each side reads just the
layer's tensors (the family's mapping table names the HF ones, the safetensors index says which
shard holds them; megatron's sharded state dict names the checkpoint boxes). Memory: about 3.5x
the layer in fp32, one layer at a time (README, "Convert an HF checkpoint").

A DeepSeek-V3 multi-token-prediction layer k is HF layer `num_hidden_layers + k`; transformers does
not run MTP, so its inner decoder layer (megatron `mtp.layers.{k}.transformer_layer`) is
compared with HF's decoder layer built for that index (Qwen3-Next / Qwen3.5: a full-attention
layer, loaded from the release's `mtp.layers.{k}.*`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moe_sft.conversion import mapping, mcore_io
from moe_sft.conversion.dcp_reader import DistCheckpointReader
from moe_sft.conversion.export import load_model_from_checkpoint
from moe_sft.conversion.hf_source import fp8_block, load_hf_config, load_hf_source
from moe_sft.conversion.meta_model import meta_model
from moe_sft.conversion.streaming_reader import StreamingHFReader
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

# Packed documents long enough that positions matter: a wrong RoPE base gave 3.7e-4 at lengths
# 17/33/9 with a 4-dim rope head, passing the old 1e-3 tolerance (docs/parity.md).
VERIFY_LENGTHS = (160, 61, 7)
LOGIT_TOLERANCE = 1e-4  # fp32 gives ~1e-6 on these lengths


def verify(
    hf_path: str | Path,
    mcore_path: str | Path,
    sequences: list[list[int]] | None = None,
    tolerance: float = LOGIT_TOLERANCE,
) -> float:
    """Max |logit difference| between HF's model and ours on a few token sequences (fp32, CPU)."""
    from moe_sft.models.forward import packed_logits
    from moe_sft.runtime import cpu_compat

    family, hf_cfg, whole = load_hf_source(Path(hf_path))
    if sequences is None:
        g = torch.Generator().manual_seed(0)
        sequences = [torch.randint(0, hf_cfg.vocab_size, (n,), generator=g).tolist() for n in VERIFY_LENGTHS]
    with cpu_compat.suspended(), torch.no_grad():
        hf_model = reference_model(family, hf_cfg, hf_path, whole)
        refs = [hf_model(torch.tensor([seq])).logits[0].float() for seq in sequences]
    del hf_model
    model = load_model_from_checkpoint(mcore_path, precision="fp32").eval()
    ours = packed_logits(model, sequences, hf_cfg.vocab_size)
    return max((ref - mine).abs().max().item() for ref, mine in zip(refs, ours))


def reference_model(family, hf_cfg, hf_path: str | Path, whole=None):
    """transformers' whole model of the source, in fp32 (a multimodal source, `whole`: its own
    class, run on text alone).

    A quantised source (FP8 blocks, MXFP4) is loaded from a dequantised copy: each weight
    dequantised in fp32 by the converter's reader and rounded once to bf16, the values the
    converted checkpoint stores (conversion/fp8.py, DeepSeek-V3's `weight_dequant`). transformers'
    own CPU path is no reference for it: it derives the block size from the scale grid (rows //
    scale rows), which misplaces the scales of a weight whose rows are not a multiple of 128 (192
    rows, 2 scale rows: 96-row blocks), and at fp32 it keeps the unrounded weights; on the tests'
    tiny FP8 DeepSeek-V3 that reference was 2.6e-3 away from a correct conversion (docs/families.md).
    """
    model_class = whole.spec.hf_model_class if whole is not None else family.hf_model_class
    hf_cfg = whole.config if whole is not None else hf_cfg  # quantization_config is at its top
    if not getattr(hf_cfg, "quantization_config", None):
        return model_class.from_pretrained(str(hf_path), dtype=torch.float32).eval()
    log.info(
        "verify: %s is quantised; the reference is transformers' model of its weights dequantised in "
        "fp32 and rounded to bf16 (as the converted checkpoint stores them), run in fp32",
        hf_path,
    )
    with tempfile.TemporaryDirectory(prefix="moe_sft_verify_") as copy_dir:
        _write_dequantised_copy(Path(hf_path), hf_cfg, Path(copy_dir))
        return model_class.from_pretrained(copy_dir, dtype=torch.float32).eval()


def _write_dequantised_copy(hf_path: Path, hf_cfg, out: Path) -> None:
    """`hf_path` as a plain checkpoint in `out`: dequantised weights, no quantization_config."""
    from safetensors.torch import save_file

    reader = StreamingHFReader(hf_path, fp8_block=fp8_block(hf_cfg))
    try:
        tensors = {name: reader.get(name).contiguous() for name in reader.names()}
    finally:
        reader.close()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_path / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------------------------------------
# Layer by layer
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerParity:
    """One layer's comparison. `scale` is the largest |HF output - input|: what the layer adds to
    the residual stream (the input itself passes through both sides unchanged, so measuring
    against the whole output would hide a wrong layer behind the residual)."""

    layer: int  # HF index; MTP layer k is num_hidden_layers + k
    kind: str  # "dense", "moe", "mtp 0 (moe)"
    max_abs_diff: float
    scale: float
    experts_routed: tuple[int, int] | None  # (experts that got a token, experts) in MoE layers
    seconds: float

    @property
    def rel_diff(self) -> float:
        return self.max_abs_diff / max(self.scale, 1e-30)

    def passed(self, tolerance: float) -> bool:
        return self.rel_diff <= tolerance  # False for NaN: a layer that yields NaN has failed

    def line(self, tolerance: float) -> str:
        routed = f", experts routed {self.experts_routed[0]}/{self.experts_routed[1]}" if self.experts_routed else ""
        verdict = "ok" if self.passed(tolerance) else f"FAIL (> {tolerance:g})"
        return (
            f"layer {self.layer} ({self.kind}): max abs diff {self.max_abs_diff:.3e} = "
            f"{self.rel_diff:.3e} of the layer's output scale {self.scale:.3e}{routed} "
            f"[{self.seconds:.1f}s] {verdict}"
        )


def choose_layers(family, hf_cfg, choice: str) -> list[int]:
    """HF layer indices from `auto` (first dense, first MoE, the first linear-attention layer of a
    hybrid model, last decoder layer and the first MTP layer, those that exist), `all`, or a comma list such as `0,3,61` (MTP k: num_hidden_layers + k)."""
    n, mtp = hf_cfg.num_hidden_layers, family.num_mtp_layers(hf_cfg)
    choice = choice.strip().lower()
    if choice == "all":
        return list(range(n + mtp))
    if choice == "auto":
        dense = [i for i in range(n) if not family.is_moe_layer(hf_cfg, i)]
        moe = [i for i in range(n) if family.is_moe_layer(hf_cfg, i)]
        linear = [i for i in range(n) if family.is_linear_attention_layer(hf_cfg, i)]
        picked = dense[:1] + moe[:1] + linear[:1] + [n - 1] + ([n] if mtp else [])
        return sorted(set(picked))
    try:
        layers = [int(part) for part in choice.split(",") if part.strip()]
    except ValueError:
        layers = []
    if not layers or any(not 0 <= i < n + mtp for i in layers):
        mtp_note = f" ({n}..{n + mtp - 1} are the MTP layers)" if mtp else ""
        raise ValueError(
            f"--verify-layers {choice!r}: use auto, all or comma-separated layer indices in [0, {n + mtp}){mtp_note}"
        )
    return sorted(set(layers))


def document_lengths(tokens: int) -> list[int]:
    """Three documents of unequal lengths (packing and per-document positions both matter)."""
    if tokens < 16:
        raise ValueError(f"--verify-tokens {tokens}: use 16 or more tokens")
    first, second = tokens // 2 + 5, tokens // 3
    return [first, second, tokens - first - second]


def verify_layers(
    hf_path: str | Path,
    mcore_path: str | Path,
    layers: str = "auto",
    tokens: int = 128,
    seed: int = 0,
    on_result: Callable[[LayerParity], None] | None = None,
) -> list[LayerParity]:
    """Compare the chosen layers (see `choose_layers`), one at a time; `on_result` sees each.

    Each side follows its own config.json: HF's layers the HF checkpoint's, ours the converted
    checkpoint's copy (which says 0 MTP layers where conversion dropped MTP layers the HF
    checkpoint lacked; the layers to compare are chosen from it).
    """
    mcore_path = Path(mcore_path)
    mcore_io.read_meta(mcore_path)
    family, hf_cfg = load_hf_config(mcore_path / mcore_io.HF_SUBDIR)
    _, source_cfg, whole = load_hf_source(Path(hf_path), check_supported=False)
    chosen = choose_layers(family, hf_cfg, layers)
    lengths = document_lengths(tokens)
    hidden = torch.randn(sum(lengths), hf_cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    ours = meta_model(family, hf_cfg, "fp32").eval()  # also sets up megatron's single-rank runtime
    theirs = _HFLayers(family, source_cfg, hf_path, whole)
    stored = DistCheckpointReader(mcore_path)
    entries = mapping.expand(family, hf_cfg)
    results = []
    try:
        for index in chosen:
            started = time.time()
            prefix = _megatron_prefix(index, hf_cfg.num_hidden_layers)
            # the HF tensors of this layer, as the family's mapping table names them
            names = [n for e in entries if e.mcore.startswith(prefix) for n in e.hf]
            ref = theirs.run(index, names, hidden, lengths)
            out, routed = _run_megatron_layer(ours, prefix, stored, hidden, lengths)
            result = LayerParity(
                index,
                _kind(family, hf_cfg, index),
                (out - ref).abs().max().item(),
                (ref - hidden).abs().max().item(),
                routed,
                time.time() - started,
            )
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        theirs.close()
        stored.close()
    return results


def _kind(family, hf_cfg, index: int) -> str:
    n = hf_cfg.num_hidden_layers
    mlp = "moe" if family.is_moe_layer(hf_cfg, index) else "dense"
    if index < n and family.is_linear_attention_layer(hf_cfg, index):
        mlp = f"linear attention, {mlp}"
    return f"mtp {index - n} ({mlp})" if index >= n else mlp


def _megatron_prefix(index: int, num_layers: int) -> str:
    """The state-dict prefix of HF layer `index` in our model (as mapping.expand names them)."""
    if index < num_layers:
        return f"decoder.layers.{index}."
    return f"mtp.layers.{index - num_layers}.transformer_layer."


# ------------------------------------------------------------------------------------------------
# HF's side
# ------------------------------------------------------------------------------------------------


class _HFLayers:
    """transformers' model of this config on the meta device; `run` materialises one layer."""

    def __init__(self, family, hf_cfg, hf_path, whole=None):
        """`whole`: a multimodal source's composite view (its language model's tensors are named
        as it names them; its layers are the text model's, which is built here)."""
        from moe_sft.runtime import cpu_compat

        self.rename = whole.hf_name if whole is not None else (lambda name: name)
        cfg = copy.deepcopy(hf_cfg)
        cfg._attn_implementation = "eager"  # the plain softmax(QK^T)V reference, with our mask
        self.reader = StreamingHFReader(hf_path, fp8_block=fp8_block(whole.config if whole is not None else hf_cfg))
        with cpu_compat.suspended():
            with torch.device("meta"):
                self.model = family.hf_model_class(cfg)
            self.base = self.model.base_model
            for name in ("layers", "rotary_emb"):
                if not hasattr(self.base, name):
                    raise TypeError(
                        f"{type(self.base).__name__} has no `{name}`; layer-wise verify "
                        "needs a decoder-only transformers model with shared rotary embeddings"
                    )
            layers = self.base.layers
            # MTP layers: transformers builds none; its decoder-layer class at index N + k is the
            # reference for their inner layer (DeepSeek-V3's MTP layers are decoder layers). A
            # hybrid model's layer picks its mixer from layer_types[index]: MTP layers run full
            # attention (mapping._layer_ids; vLLM's Qwen3-Next MTP layer).
            mtp = family.num_mtp_layers(hf_cfg)
            mtp_cfg = copy.deepcopy(cfg)
            if mtp and getattr(cfg, "layer_types", None):
                mtp_cfg.layer_types = list(cfg.layer_types) + ["full_attention"] * mtp
            with torch.device("meta"):
                for k in range(mtp):
                    layers.append(type(layers[0])(mtp_cfg, cfg.num_hidden_layers + k))
            self.family, self.num_layers = family, cfg.num_hidden_layers
            self.rotary = type(self.base.rotary_emb)(config=cfg)  # real: a small frequency table

    @torch.no_grad()
    def run(self, index: int, names: list[str], hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """HF layer `index` loaded with the checkpoint tensors `names`, each document run alone."""
        from moe_sft.runtime import cpu_compat

        with cpu_compat.suspended():
            layer = self._load(index, names)
            try:
                outs = []
                for doc in torch.split(hidden, lengths):
                    x = doc[None]
                    positions = torch.arange(len(doc))[None]
                    causal = torch.full((len(doc), len(doc)), torch.finfo(x.dtype).min).triu(1)
                    if window := self._sliding_window(index):  # keys at q - k >= window are out too
                        causal = causal + torch.full_like(causal, torch.finfo(x.dtype).min).tril(-window)
                    out = layer(
                        x,
                        # a linear-attention layer reads a [batch, tokens] padding mask; none: no padding
                        attention_mask=None if self._linear_attention(index) else causal[None, None],
                        position_ids=positions,
                        position_embeddings=self._position_embeddings(index, x, positions),
                        **self._shared_kv(layer),
                    )
                    outs.append((out[0] if isinstance(out, tuple) else out)[0])
                return torch.cat(outs)
            finally:
                layer.to("meta")  # back to no storage: one layer at a time

    def _position_embeddings(self, index: int, x: torch.Tensor, positions: torch.Tensor):
        """transformers' (cos, sin) for layer `index`: a model whose RoPE differs per layer type
        (Gemma 4) takes the layer's type."""
        if "layer_type" in inspect.signature(self.rotary.forward).parameters:
            return self.rotary(x, positions, self.model.config.layer_types[index])
        return self.rotary(x, positions)

    @staticmethod
    def _shared_kv(layer) -> dict:
        """A Gemma 4 layer writes its keys and values into `shared_kv_states` for the layers that
        share them (none here: one layer runs alone)."""
        return {"shared_kv_states": {}} if "shared_kv_states" in inspect.signature(layer.forward).parameters else {}

    def _model_name(self, index: int, name: str) -> str:
        """A checkpoint name as transformers' model (with the MTP layers appended) names it: a
        family whose release keeps MTP layer k elsewhere (Qwen3-Next's `mtp.layers.{k}.`) has it
        renamed to `model.layers.{N + k}.`."""
        prefix = self.family.mtp_layer_hf_prefix
        if index < self.num_layers or not prefix:
            return name
        at = prefix.format(mtp=index - self.num_layers)
        return mapping.HF_LAYER.format(layer=index) + name[len(at) :] if name.startswith(at) else name

    def _linear_attention(self, index: int) -> bool:
        types = getattr(self.model.config, "layer_types", None) or []
        return index < len(types) and types[index] == "linear_attention"

    def _sliding_window(self, index: int) -> int | None:
        """The window of a layer transformers runs with sliding-window attention (`layer_types`)."""
        cfg = self.model.config
        types = getattr(cfg, "layer_types", None) or []
        sliding = index < len(types) and types[index] == "sliding_attention"
        return getattr(cfg, "sliding_window", None) if sliding else None

    def _load(self, index: int, names: list[str]):
        """Layer `index` with the checkpoint tensors `names`, through the two steps of
        `from_pretrained` that matter here: the model's registered weight conversions (renames,
        experts fused into one tensor) and their application to the model's parameters."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        layer = self.base.layers[index]
        tensors = {
            self._model_name(index, name): self.reader.get(self.rename(name)) for name in names
        }  # FP8: dequantised
        config = LoadStateDictConfig(dtype=torch.float32, weight_mapping=get_model_conversion_mapping(self.model))
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a "Loading weights" bar per layer says nothing here
        try:
            info, _ = convert_and_load_state_dict_in_model(self.model, tensors, config)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        del tensors
        unused = sorted(info.unexpected_keys) + sorted(map(str, info.mismatched_keys))
        errors = info.conversion_errors or {}
        empty = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if unused or errors or empty:
            raise RuntimeError(
                f"HF layer {index} ({type(layer).__name__}): transformers did not load tensors "
                f"{unused[:5]} / failed on {list(errors)[:5]}; parameters left without a value: "
                f"{empty[:5]}. The family's mapping names these HF tensors for the layer: {names[:5]}..."
            )
        return layer.float().eval()

    def close(self) -> None:
        self.reader.close()


# ------------------------------------------------------------------------------------------------
# Our side
# ------------------------------------------------------------------------------------------------


def _submodule(model, prefix: str):
    module = model
    for part in prefix.strip(".").split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _materialise(module) -> None:
    """Give the meta tensors of `module` (uninitialised) CPU storage; real ones (rotary tables that
    megatron allocates on an explicit device) stay as they are. A meta tensor's storage cannot be
    swapped in place (`.data =` refuses), so parameters are replaced, keeping the attributes
    megatron set on them (tensor-parallel partition, expert flags)."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                real = torch.nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad)
                real.__dict__.update(param.__dict__)
                sub._parameters[name] = real
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device="cpu")


def _load_megatron_layer(model, prefix: str, reader):
    """The layer at `prefix` with its tensors read from the dist checkpoint, nothing else.

    The whole (meta) model's sharded state dict gives the layer's checkpoint keys and boxes as
    the converter wrote them (per-layer keys, or row i of layer-stacked tensors when all layers
    are alike, e.g. Mixtral's). Each box is read with `DistCheckpointReader`, as the exporter
    reads; megatron's own `dist_checkpointing.load` refuses a part of a layer-stacked tensor
    (its torch ShardedTensor wants every fragment of the key on the loading ranks). The factory
    steps (experts stored per expert) are megatron's, as in its `load`.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    layer = _submodule(model, prefix)
    _materialise(layer)
    wanted = {k: v for k, v in model.sharded_state_dict().items() if k.startswith(prefix)}
    sharded, nonpersistent, factories = load_preprocess(wanted)
    stored = reader.tensors()

    def read(item):
        if isinstance(item, ShardedObject) and item.key.endswith("._extra_state"):
            return None  # what megatron's linears hold there (TE's FP8 metadata: not used here)
        if not isinstance(item, ShardedTensor) or item.flattened_range is not None:
            raise TypeError(
                f"{prefix}: {type(item).__name__} {getattr(item, 'key', '')!r} in the "
                "layer's sharded state; only whole ShardedTensor boxes are read"
            )
        box = item.data[(None,) * item.prepend_axis_num]  # the layer-stack axes, as stored
        md = stored.get(item.key)
        if md is None or md.properties.dtype == box.dtype:
            reader.read_into(item.key, item.global_offset, box)  # names the key when missing
        else:  # a bf16 checkpoint read into the fp32 layer
            raw = torch.empty(box.shape, dtype=md.properties.dtype)
            reader.read_into(item.key, item.global_offset, raw)
            box.copy_(raw)
        return item.data

    dict_list_map_inplace(read, sharded)
    merge(sharded, nonpersistent)
    state = apply_factory_merges(sharded, factories)
    layer.load_state_dict({k[len(prefix) :]: v for k, v in state.items()})
    return layer


@torch.no_grad()
def _run_megatron_layer(model, prefix: str, reader, hidden: torch.Tensor, lengths: list[int]):
    """(output [tokens, hidden], experts routed) of our layer on the packed documents."""
    from moe_sft.models.forward import packed_seq_params

    layer = _load_megatron_layer(model, prefix, reader)
    try:
        params = packed_seq_params(torch.tensor([0] + lengths).cumsum(0), max(lengths))
        rotary = None
        # MLA's and Gemma 4's attention make their own from params (GPTModel then has none)
        if not model.config.multi_latent_attention and hasattr(model, "rotary_pos_emb"):
            rotary = model.rotary_pos_emb(max(lengths), packed_seq=True)  # as GPTModel._preprocess
            if isinstance(rotary, tuple):  # YaRN (gpt-oss) also returns its cos/sin scale
                rotary = rotary[0]
        routed = {}
        router = getattr(layer.mlp, "router", None)
        hook = (
            router.register_forward_hook(lambda m, a, out: routed.__setitem__("map", out[1]))
            if router is not None
            else None
        )
        try:
            out, _ = layer(
                hidden_states=hidden[:, None], attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=params
            )
        finally:
            if hook is not None:
                hook.remove()
        counts = None
        if "map" in routed:
            counts = (int(routed["map"].any(0).sum()), routed["map"].shape[-1])
        return out[:, 0].float(), counts
    finally:
        layer.to("meta")
