"""Expert parallelism on torch.distributed: launch environment, backend choice, process-group
mesh, group size and rank (``None``: no group), collectives as autograd Functions, token
dispatchers and expert sharding. Communication volume:
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
from .dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    LocalDispatcher,
    TokenDispatcher,
    allgather_dispatch,
    alltoall_dispatch,
    make_dispatcher,
)
from .env import LaunchEnv, check_group_device, choose_backend, detect_launch_env, init_distributed
from .groups import global_rank, group_rank, group_size
from .mesh import ParallelMesh
from .sharding import (
    expert_range,
    gather_full_state_dict,
    is_expert_weight,
    merge_v4_expert_keys,
    scatter_full_state_dict,
    shard_state_dict,
)

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "LaunchEnv",
    "LocalDispatcher",
    "ParallelMesh",
    "TokenDispatcher",
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
    "global_rank",
    "group_rank",
    "group_size",
    "init_distributed",
    "is_expert_weight",
    "make_dispatcher",
    "merge_v4_expert_keys",
    "reduce_scatter_dim0",
    "scatter_full_state_dict",
    "shard_state_dict",
]
