"""LoRA and DoRA adapters on a frozen base: placement by target patterns (targets.py), the
adapters beside megatron's TP linears (linear.py) and inside the grouped experts (experts.py),
installing them (install.py), their checkpoint entries (state.py)."""
