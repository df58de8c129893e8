"""The single-rank (TP=PP=EP=1) GPTModel on CPU in this process: the converter's, exporter's and
--verify's view of a model (meta_model.py builds the same model on the meta device)."""

from __future__ import annotations

import torch

from moe_sft.kernels import install as kernels_install
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.runtime import device as rdevice
from moe_sft.runtime import distributed


def init_single_rank(precision: str = "fp32") -> None:
    """megatron's fixes (+ the CPU emulation), the default kernels, a process group of one and
    megatron's parallel state (TP=PP=EP=1)."""
    choice = rdevice.RuntimeChoice("cpu", precision, "torch", ("offline tool",))
    if not torch.cuda.is_available():
        rdevice.prepare_runtime(choice)
    else:
        rdevice.prepare_runtime(rdevice.RuntimeChoice("cuda", precision, "torch", ()))
    kernels_install.install()
    distributed.init_process_group("cpu" if not torch.cuda.is_available() else "cuda")
    distributed.init_model_parallel()


def build_single_rank_model(family, hf_cfg, precision: str = "fp32"):
    """The GPTModel of `single_rank_model`, in an already initialised single-rank runtime."""
    opts = ModelOptions(precision=precision, backend="torch", device="cpu")
    config = build_transformer_config(family, hf_cfg, opts)
    return build_model_chunks(family, hf_cfg, config, opts)[0]


def single_rank_model(family, hf_cfg, precision: str = "fp32"):
    """A TP=PP=EP=1 GPTModel on CPU in this process (the exporter's and --verify's view)."""
    init_single_rank(precision)
    return build_single_rank_model(family, hf_cfg, precision)
