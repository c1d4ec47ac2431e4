"""Launch environment: rank detection, communication-backend choice, process-group start-up.

Ranks come from ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or from MPI launchers: Open
MPI (``OMPI_COMM_WORLD_*``), Cray PALS as used by Aurora's ``mpiexec`` (``PALS_RANKID``,
``PALS_LOCAL_RANKID``, with ``PMI_SIZE``), and PMI launchers such as Intel MPI / MPICH hydra
(``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``). The communication backend follows the device:
xpu -> ``xccl`` (PyTorch >= 2.8 built with XCCL) else ``ccl`` (``oneccl_bindings_for_pytorch``),
cuda -> ``nccl``, cpu -> ``gloo``; ``FASTMOE_DIST_BACKEND`` overrides the choice.
"""
from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from .. import settings
from ..device import accelerator_type

#: Environment variable that forces the communication backend (e.g. ``gloo``, ``ccl``, ``xccl``).
BACKEND_ENV = "FASTMOE_DIST_BACKEND"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    #: Rank within the node, or None when the launcher does not say.
    local_rank: int | None
    #: Processes on this node, or None when the launcher does not say.
    local_world_size: int | None
    #: Which launcher's variables were read: "torchrun", "openmpi", "pals", "pmi", "slurm" or "none".
    launcher: str


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    return None


# (launcher, rank variables, world-size variables); the first launcher whose rank and size are both set wins.
_LAUNCHERS = (
    ("torchrun", ("RANK",), ("WORLD_SIZE",)),
    ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",)),
    # PALS exports the rank but not the world size; Cray PMI (always there under PALS) does.
    ("pals", ("PALS_RANKID",), ("PMI_SIZE", "PALS_SIZE")),
    ("pmi", ("PMI_RANK",), ("PMI_SIZE",)),
    ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS",)),
)
_LOCAL_RANK_VARS = (
    "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
)
_LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS",
)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and local rank from the launcher's environment variables.

    With no launcher variables at all this is a single process (rank 0 of 1).
    """
    env = os.environ if environ is None else environ
    for launcher, rank_vars, size_vars in _LAUNCHERS:
        rank = _int_env(env, *rank_vars)
        size = _int_env(env, *size_vars)
        if rank is None or size is None:
            continue
        local_rank = _int_env(env, *_LOCAL_RANK_VARS)
        local_size = _int_env(env, *_LOCAL_SIZE_VARS)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{launcher} environment gives rank {rank} of world size {size}: need 0 <= rank < size")
        if local_rank is not None and local_rank < 0:
            raise ValueError(f"{launcher} environment gives a negative local rank {local_rank}")
        if local_size is not None and local_rank is not None and local_rank >= local_size:
            raise ValueError(f"{launcher} environment gives local rank {local_rank} of local size {local_size}")
        return LaunchEnv(rank, size, local_rank, local_size, launcher)
    return LaunchEnv(0, 1, 0, 1, "none")


def _oneccl_importable() -> bool:
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except Exception:  # absent, or present but broken against this torch: either way unusable
        return False
    return True


def _xccl_available() -> bool:
    probe = getattr(dist, "is_xccl_available", None)
    return bool(probe()) if probe is not None else False


def choose_backend(device_type: str | None = None) -> str:
    """The communication backend for ``device_type`` (default: the best accelerator present).

    ``FASTMOE_DIST_BACKEND`` wins when set. xpu: ``xccl`` when this PyTorch has it, else ``ccl``
    when ``oneccl_bindings_for_pytorch`` imports (importing it registers the backend); cuda:
    ``nccl``; cpu: ``gloo``.
    """
    forced = settings.get().dist_backend
    if forced:
        if forced == "ccl":
            _oneccl_importable()  # registers "ccl" with torch.distributed if it is installed
        return forced
    dev = device_type or accelerator_type()
    if dev == "xpu":
        if _xccl_available():
            return "xccl"
        if _oneccl_importable():
            return "ccl"
        raise RuntimeError(
            "no communication backend for xpu: this PyTorch has no XCCL (torch.distributed.is_xccl_available() "
            "is False) and oneccl_bindings_for_pytorch does not import; install one, or set "
            f"{BACKEND_ENV}=gloo to run collectives through the CPU"
        )
    if dev == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError(f"this PyTorch has no NCCL; set {BACKEND_ENV}=gloo to use gloo instead")
        return "nccl"
    if dev == "cpu":
        return "gloo"
    raise ValueError(f"no default communication backend for device type {dev!r}; set {BACKEND_ENV}")


def _set_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, device_type)
    count = mod.device_count()
    if count < 1:
        raise RuntimeError(f"device type {device_type!r} requested but no {device_type} device is visible")
    index = local_rank % count
    mod.set_device(index)
    return torch.device(device_type, index)


def init_distributed(
    backend: str | None = None,
    device_type: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> tuple[LaunchEnv, torch.device]:
    """Start the default process group from the launcher's environment; returns
    ``(launch_env, device)``, the device being this process's accelerator (chosen by local rank).

    Idempotent: when a group already exists it is left as is. Under an MPI launcher
    ``MASTER_PORT`` must be set by the job script (no port can be agreed without communicating);
    ``MASTER_ADDR`` defaults to ``localhost`` for single-node jobs.
    """
    info = detect_launch_env()
    dev_type = device_type or accelerator_type()
    local_rank = info.local_rank if info.local_rank is not None else info.rank
    device = _set_device(dev_type, local_rank)
    if dist.is_available() and dist.is_initialized():
        return info, device
    backend = backend or choose_backend(dev_type)
    if info.world_size > 1:
        single_node = info.local_world_size is not None and info.local_world_size == info.world_size
        if "MASTER_ADDR" not in os.environ:
            if not single_node:
                raise RuntimeError(
                    f"MASTER_ADDR is not set for a {info.world_size}-process {info.launcher} job spanning nodes; "
                    "export it (the host of rank 0) in the job script"
                )
            os.environ["MASTER_ADDR"] = "localhost"
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError(f"MASTER_PORT is not set for a {info.world_size}-process {info.launcher} job")
    else:
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size, timeout=timeout
    )
    return info, device


# ---------------------------------------------------------------- group / device compatibility
# Device types each backend runs collectives on, for backends that name only themselves.
_BACKEND_DEVICES = {
    "gloo": ("cpu",),
    "mpi": ("cpu",),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "ccl": ("xpu", "cpu"),
}


def group_device_types(group: dist.ProcessGroup | None) -> tuple[str, ...] | None:
    """Device types ``group`` can run collectives on, or None when the backend is unknown to us."""
    config = str(dist.get_backend_config(group))
    if ":" in config:  # "cpu:gloo,cuda:nccl" style
        return tuple(part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part)
    return _BACKEND_DEVICES.get(config.strip().lower())


def check_group_device(group: dist.ProcessGroup | None, device: torch.device, what: str = "expert parallelism") -> None:
    """Raise ValueError when ``group`` cannot run collectives on ``device``'s tensors.

    Deterministic and local: every rank of a consistently built job raises the same error, so no
    rank is left waiting in a collective.
    """
    types = group_device_types(group)
    if types is not None and device.type not in types:
        raise ValueError(
            f"{what}: the process group's backend ({dist.get_backend_config(group)}) runs collectives on "
            f"{list(types)} tensors, but the block's tensors are on {device}; build the group with "
            f"backend {choose_backend_name_for(device.type)!r} or move the block"
        )


def choose_backend_name_for(device_type: str) -> str:
    """The backend one would normally use for ``device_type`` (for error messages; no probing)."""
    return {"xpu": "xccl", "cuda": "nccl"}.get(device_type, "gloo")
