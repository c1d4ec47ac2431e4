"""Tensors in and out through torch.distributed.checkpoint (DCP), the ranks' agreement on every
outcome (so that all of them take the same branch), and errors described in one line."""
from __future__ import annotations

import errno
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import dist_on

from .slots import CheckpointError

def agree(ok: bool, message: str, payload: Any = None, group: Any = None) -> list[tuple[bool, str, Any]]:
    """Every rank's ``(ok, message, payload)``; one all-gather (on ``group``, None: the default
    group), so all ranks take the same branch."""
    mine = (ok, message, payload)
    if not dist_on():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def raise_if_failed(results: list[tuple[bool, str, Any]], what: str) -> None:
    bad = [(r, msg) for r, (ok, msg, _) in enumerate(results) if not ok]
    if bad:
        r, msg = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise CheckpointError(f"{what}: rank {r}: {msg}{more}")


def broadcast_object(obj: Any) -> Any:
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - older torch
    class CheckpointException(BaseException):  # type: ignore[no-redef]
        pass


def describe_os_error(e: BaseException, path: Path | None = None, needed: int | None = None) -> str:
    """The reason of a failed read or write in a few words; a full disk as such, naming ``path``
    with the ``needed`` bytes and those free (trainer/ft/space.py)."""
    from ..ft.space import describe_space

    space = describe_space(e, path, needed) if path is not None else None
    if space is not None:
        return space
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on device ({e})"
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the output directory is not writable ({e})"
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        # DCP gathers every rank's exception; name the first rank and its underlying error
        rank, first = next(iter(sorted(failures.items())))
        cause = first[0] if isinstance(first, tuple) else first
        return f"rank {rank}: {describe_os_error(cause)}"
    return f"{type(e).__name__}: {e}"


def storage_writer(path: Path) -> Any:
    """The DCP writer (one file per rank, fsynced); a separate function so tests can make it fail."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)


def storage_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def dcp_save(state: dict[str, torch.Tensor], path: Path, group: Any = None) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, storage_writer=storage_writer(path), no_dist=not dist_on(), process_group=group)


def dcp_load(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(state, storage_reader=storage_reader(path), no_dist=not dist_on())
        except CheckpointException as e:
            raise CheckpointError(f"reading {path} failed: {describe_os_error(e)}") from None


def _key_problem(path: Path, want: Mapping[str, torch.Tensor]) -> str | None:
    md = storage_reader(path).read_metadata().state_dict_metadata
    missing = [k for k in want if k not in md]
    if missing:
        return (f"{path} has no tensor {missing[0]!r} ({len(missing)} missing): it was written for a different "
                "model, or without optimizer state")
    for k, t in want.items():
        size = tuple(md[k].size)
        if size != tuple(t.shape):
            return f"{path}: tensor {k!r} has shape {list(size)}, this model expects {list(t.shape)}"
    return None


def check_keys(path: Path, want: Mapping[str, torch.Tensor]) -> None:
    """Every rank's wanted keys exist in the checkpoint with the wanted shapes, else the same clear
    error on every rank (collective: a rank must not enter the load while another gave up)."""
    try:
        problem = _key_problem(path, want)
    except Exception as e:  # an unreadable index
        problem = f"{path}: cannot read the checkpoint index: {describe_os_error(e)}"
    results = agree(problem is None, problem or "")
    bad = [msg for ok, msg, _ in results if not ok]
    if bad:
        raise CheckpointError(bad[0])


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def dtensor_params(model: nn.Module) -> list[str]:
    """Names of the trainable weights held as DTensors (sharded by FSDP2 under
    ``--parallel.dp_shard fsdp``): checkpointed whole under their plain key, each rank writing and
    reading its own shard through DCP."""
    return [n for n, p in model.named_parameters() if p.requires_grad and is_dtensor(p)]
