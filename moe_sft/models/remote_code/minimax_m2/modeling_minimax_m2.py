"""The `modeling_minimax_m2.py` of a moe-sft MiniMax-M2 checkpoint (`auto_map`:
`AutoModelForCausalLM: modeling_minimax_m2.MiniMaxM2ForCausalLM`): transformers' MiniMax-M2 model
under configuration_minimax_m2.py's config; see that file.
"""

from transformers import MiniMaxM2ForCausalLM as _MiniMaxM2ForCausalLM

from .configuration_minimax_m2 import MiniMaxM2Config


class MiniMaxM2ForCausalLM(_MiniMaxM2ForCausalLM):
    config_class = MiniMaxM2Config
