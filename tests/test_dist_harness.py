"""The gloo process harness the distributed tests stand on: results in rank order, failures fast."""
import time

import pytest

from tests.parallel_util import run_workers


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _rank1_fails_while_rank0_waits():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone
    return "unreachable"


def test_results_come_back_in_rank_order():
    assert run_workers(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_first_failure_ends_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 gives up") as err:
        run_workers(_rank1_fails_while_rank0_waits, 2, timeout_s=100)
    assert "--- rank 1 ---" in str(err.value)
    assert time.monotonic() - t0 < 60  # not the 100 s timeout, nor rank 0's 120 s collective timeout
