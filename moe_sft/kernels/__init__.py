"""Triton kernels and fused replacements of megatron-core functions (speed only: every one computes
what the function it replaces computes). `install.py` is the one place that installs them, behind
the `kernels` config section."""
