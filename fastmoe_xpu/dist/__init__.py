"""Expert parallelism on torch.distributed: launch environment, backend choice, process-group
mesh, collectives as autograd Functions, token dispatch and expert sharding. Communication volume:
:mod:`fastmoe_xpu.dist.comm_bytes`."""
from .collectives import (
    agree_on_inputs,
    all_gather_dim0,
    all_to_all_autograd,
    all_to_all_dim0,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
    reduce_scatter_dim0,
)
from .dispatch import allgather_dispatch, alltoall_dispatch
from .env import LaunchEnv, check_group_device, choose_backend, detect_launch_env, init_distributed
from .mesh import ParallelMesh
from .sharding import (
    expert_range,
    gather_full_state_dict,
    merge_v4_expert_keys,
    scatter_full_state_dict,
    shard_state_dict,
)

__all__ = [
    "LaunchEnv",
    "ParallelMesh",
    "agree_on_inputs",
    "all_gather_dim0",
    "all_to_all_autograd",
    "all_to_all_dim0",
    "allgather_dispatch",
    "alltoall_dispatch",
    "check_group_device",
    "choose_backend",
    "detect_launch_env",
    "expert_range",
    "forward_allgather",
    "forward_allgather_backward_reducescatter",
    "forward_reducescatter_backward_allgather",
    "gather_full_state_dict",
    "init_distributed",
    "merge_v4_expert_keys",
    "reduce_scatter_dim0",
    "scatter_full_state_dict",
    "shard_state_dict",
]
