"""The `configuration_deepseek.py` of a moe-sft DeepSeek-V3 (deepseek-ai/DeepSeek-V3) checkpoint: the module the
release's `auto_map` names (`AutoConfig: configuration_deepseek.DeepseekV3Config`), so that
`trust_remote_code=True` (transformers, vLLM) loads the checkpoint as it loads the release.

It is not the release's file (moe-sft cannot download it): it is transformers' own DeepseekV3Config
under `model_type: deepseek_v3`, the classes moe-sft converts to and checks against. Shipped by
`python -m moe_sft.quickstart_model` beside the tiny model and carried through conversion and
export like the release's own files (docs/families.md).
"""

from transformers import DeepseekV3Config as _DeepseekV3Config


class DeepseekV3Config(_DeepseekV3Config):
    model_type = "deepseek_v3"


def _register_checkpoint_layout() -> None:
    """transformers 5 loads the per-expert tensors of the checkpoint into fused experts through
    the conversion mapping of the model type, which it skips for remote code that did not
    register one: register DeepSeek-V3's (transformers 4 has no mapping and needs none)."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    register_checkpoint_conversion_mapping(
        "deepseek_v3", get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True
    )


_register_checkpoint_layout()
