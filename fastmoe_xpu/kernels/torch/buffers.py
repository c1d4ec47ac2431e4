"""The torch backend's CPU buffers: a bounded pool that keeps big row buffers mapped between calls.

Why: glibc serves every allocation over 32 MiB with a fresh ``mmap`` and unmaps it at free, so each
training step would fault the layer's row buffers and weight gradients in again page by page, each
page zeroed by the kernel: that costs more than a full pass over the memory.

Bounds (``fastmoe_xpu.settings``): ``FASTMOE_CPU_CACHE=0`` turns the pool off; at most
``FASTMOE_CPU_CACHE_IDLE_MB`` (default 4096 MiB) of idle buffers are kept; buffers in use belong to
live tensors and are freed with them once the pool is released. :func:`release_buffers` (exported as
``fastmoe_xpu.release_buffers``) returns every idle buffer to the allocator, e.g. after training.
"""
from __future__ import annotations

import math
import threading

import torch

from ... import settings


class _CpuBufferCache:
    """Keeps the big CPU buffers of stages 4-5 mapped between calls.

    Like the CUDA caching allocator, this cache hands a storage out again once nothing but the
    cache refers to it (storage use count 1), so a storage is never shared with a live tensor.
    Storages are grouped in size classes (8 per power of two); idle storages beyond ``max_idle``
    bytes are released when a new one is allocated.
    """

    MIN_BYTES = 1 << 20  # smaller blocks come from glibc's heap, which recycles them already

    def __init__(self, enabled: bool | None = None, max_idle_mb: float | None = None) -> None:
        cfg = settings.get()
        # The use count is what makes reuse safe; without it (an older torch) nothing is cached.
        self.enabled = hasattr(torch._C, "_storage_Use_Count") and (cfg.cpu_cache if enabled is None else enabled)
        self.max_idle = int((cfg.cpu_cache_idle_mb if max_idle_mb is None else max_idle_mb) * 2**20)
        self.pool: dict[int, list[torch.UntypedStorage]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        step = max(1 << 16, 1 << max(0, nbytes.bit_length() - 4))
        return -(-nbytes // step) * step

    @staticmethod
    def _idle(st: torch.UntypedStorage) -> bool:
        return torch._C._storage_Use_Count(st._cdata) == 1

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if not self.enabled or device.type != "cpu" or nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        cls = self._size_class(nbytes)
        with self.lock:
            storage = next((st for st in self.pool.get(cls, ()) if self._idle(st)), None)
            if storage is None:
                self._trim(keep=cls)
                storage = torch.empty(cls, dtype=torch.uint8, device=device).untyped_storage()
                self.pool.setdefault(cls, []).append(storage)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    def _trim(self, keep: int) -> None:
        idle = [(c, st) for c, sts in self.pool.items() for st in sts if self._idle(st)]
        total = sum(c for c, _ in idle)
        for c, st in sorted(idle, key=lambda cs: cs[0] == keep):
            if total <= self.max_idle:
                break
            self.pool[c].remove(st)
            total -= c

    def idle_bytes(self) -> int:
        """Bytes held by the pool that no tensor uses."""
        with self.lock:
            return sum(c for c, sts in self.pool.items() for st in sts if self._idle(st))

    def clear(self) -> int:
        """Drop every storage (in-use ones live on with their tensors); returns the idle bytes freed."""
        with self.lock:
            freed = sum(c for c, sts in self.pool.items() for st in sts if self._idle(st))
            self.pool.clear()
        return freed


_CACHE = _CpuBufferCache()


def release_buffers() -> int:
    """Return the torch backend's idle cached CPU buffers to the allocator; returns the bytes freed.
    Buffers still held by tensors are freed when those tensors are."""
    return _CACHE.clear()


def cached_empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _CACHE.empty(tuple(shape), dtype or like.dtype, like.device)


def piece_rows(width: int) -> int:
    """Rows of one piece of a gather or elementwise pass: ``FASTMOE_CPU_PIECE_MB`` (default 4 MiB) of
    the widest operand. A piece stays in the last-level cache between the op that writes it and the
    ops that read it, and pieces are few: every op is a parallel region, and on a loaded machine
    each one can cost a scheduler time slice."""
    return max(8, (settings.get().cpu_piece_mb << 20) // (4 * max(1, width)))
