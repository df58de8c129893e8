"""Gemma 4's decoder layer: megatron's TransformerLayer whose output, residual included, is
multiplied by a per-layer `layer_scalar` (transformers' Gemma4TextDecoderLayer: `hidden_states *=
self.layer_scalar` after the feed-forward residual add). A persistent buffer, as in transformers:
loaded and saved with the checkpoint, never trained.

The layer spec (layers/spec.py `gemma4_layer_spec`) gives it an identity pre_mlp_layernorm (the
router reads the raw residual; the MoE block holds its own norms: layers/gemma4_moe.py) and an
attention that norms its own output.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_layer import TransformerLayer


class Gemma4TransformerLayer(TransformerLayer):
    def __init__(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None, vp_stage=None):
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        submodules = dataclasses.replace(submodules, mlp=_with_process_groups(submodules.mlp, pg_collection))
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        self.register_buffer("layer_scalar", torch.ones(1, dtype=self.config.params_dtype))

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        return super()._forward_post_mlp(mlp_output_with_bias, residual) * self.layer_scalar


def _with_process_groups(spec, pg_collection) -> SimpleNamespace:
    """megatron 0.16.1's TransformerLayer gives its process groups only to an mlp whose class is
    exactly MoELayer; a subclass's ModuleSpec gets none (the global groups, and a warning per layer).
    A spec that is not a ModuleSpec is built as it says (megatron's build_module), groups included."""
    return SimpleNamespace(
        module=spec.module, submodules=spec.submodules, params={**spec.params, "pg_collection": pg_collection}
    )
