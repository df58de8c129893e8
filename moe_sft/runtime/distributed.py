"""Process groups: torch.distributed + megatron parallel_state, on NCCL (CUDA) or gloo (CPU)."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device_type: str, timeout_minutes: int = 30) -> tuple[int, int]:
    """Join torchrun's group (env://), or make a world of one for single-process tools."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def init_model_parallel(tp=1, pp=1, vpp=None, ep=1, etp=None, cp=1, seed=1234) -> None:
    """megatron parallel_state with the given sizes (world size must already be a multiple).

    A second call (single-rank tools and tests re-initialise in one process) first destroys the
    previous layout's process groups: megatron's destroy only drops its references, and every gloo
    group keeps two threads alive (3,000+ over a test run).
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_layout(layout, seed: int = 1234) -> None:
    """megatron parallel_state for a run's layout (moe_sft/config/layout.py `Layout`: its degrees by
    name, read here without importing it, since runtime sits below config)."""
    init_model_parallel(
        tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, etp=layout.etp, cp=layout.cp, seed=seed
    )


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
