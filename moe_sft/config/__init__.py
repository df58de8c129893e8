"""Typed configuration for moe-sft: dataclass schema, Hydra-edge loader, pre-flight validation.

cfg = load_config(sys.argv[1:])          # --config-path DIR --config-name NAME key=value ...
validate_config(cfg, world_size)          # before any process group exists
validate_against_model(cfg, num_layers=..., num_experts=..., num_attention_heads=...,
                       num_query_groups=..., vocab_size=...)
"""

from moe_sft.config.load import (
    CONFIGS_DIR,
    config_from_dict,
    config_to_dict,
    load_config,
    load_recipe,
    save_resolved_config,
)
from moe_sft.config.schema import (
    SECTIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    KernelsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PeftConfig,
    TrainConfig,
    TrainerConfig,
    field_help,
    format_errors,
)
from moe_sft.config.validate import (
    CHECKS,
    data_parallel_size,
    expert_data_parallel_size,
    validate_against_model,
    validate_config,
)

__all__ = [
    "CHECKS",
    "CONFIGS_DIR",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "KernelsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PeftConfig",
    "TrainConfig",
    "TrainerConfig",
    "config_from_dict",
    "config_to_dict",
    "data_parallel_size",
    "expert_data_parallel_size",
    "field_help",
    "format_errors",
    "load_config",
    "load_recipe",
    "save_resolved_config",
    "validate_against_model",
    "validate_config",
]
