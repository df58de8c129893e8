"""The `configuration_minimax_m2.py` of a moe-sft MiniMax-M2 (MiniMaxAI/MiniMax-M2) checkpoint: the
module the release's `auto_map` names (`AutoConfig: configuration_minimax_m2.MiniMaxM2Config`), so
that `trust_remote_code=True` (transformers, vLLM) loads the checkpoint as it loads the release.

It is not the release's file (moe-sft cannot download it): it is transformers' own MiniMaxM2Config,
the class moe-sft converts to and checks against. Shipped by `python -m moe_sft.quickstart_model`
beside the tiny model and carried through conversion and export like the release's own files
(docs/families.md).
"""

from transformers import MiniMaxM2Config as _MiniMaxM2Config


class MiniMaxM2Config(_MiniMaxM2Config):
    model_type = "minimax_m2"


def _register_checkpoint_layout() -> None:
    """transformers 5 loads the per-expert tensors of the checkpoint into fused experts through
    the conversion mapping of the model type, which it skips for remote code that did not
    register one: register transformers' own MiniMax-M2 mapping."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    register_checkpoint_conversion_mapping(
        "minimax_m2", get_checkpoint_conversion_mapping("minimax_m2"), overwrite=True
    )


_register_checkpoint_layout()
