"""The `modeling_deepseek.py` of a moe-sft DeepSeek-V3 (deepseek-ai/DeepSeek-V3) checkpoint (`auto_map`:
`AutoModel: modeling_deepseek.DeepseekV3Model`, `AutoModelForCausalLM:
modeling_deepseek.DeepseekV3ForCausalLM`): transformers' DeepSeek-V3 model classes under
configuration_deepseek.py's config; see that file.
"""

from transformers import DeepseekV3ForCausalLM as _DeepseekV3ForCausalLM
from transformers import DeepseekV3Model as _DeepseekV3Model

from .configuration_deepseek import DeepseekV3Config


class DeepseekV3Model(_DeepseekV3Model):
    config_class = DeepseekV3Config


class DeepseekV3ForCausalLM(_DeepseekV3ForCausalLM):
    config_class = DeepseekV3Config
