"""fastmoe_xpu/threads.py: the processes of one machine never ask for more intra-op threads than it has
cores, take fewer where other work holds cores, follow that work during a run, and obey --threads."""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu import threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    threads._CURRENT = None


def test_default_is_the_share_of_the_cores_other_work_leaves():
    assert threads.default_threads(16, 1, 0.0, None) == 16
    assert threads.default_threads(16, 4, 0.0, None) == 4           # cores // local processes
    assert threads.default_threads(2, 3, 0.0, None) == 1            # never 0
    assert threads.default_threads(2, 1, 2.0, None) == 1            # two busy processes on two cores
    assert threads.default_threads(16, 2, 5.8, None) == 5           # 10 cores left, two processes
    assert threads.default_threads(16, 2, None, None) == 8          # load not known: the share
    assert threads.default_threads(16, 1, 0.0, 4) == 4              # OMP_NUM_THREADS caps it
    assert threads.default_threads(2, 1, 0.0, 8) == 2               # ... but never above the share


def test_local_processes_from_the_launchers(monkeypatch):
    monkeypatch.delenv(threads.LOCAL_PROCESSES_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.local_processes() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun
    assert threads.local_processes() == 2
    monkeypatch.setenv(threads.LOCAL_PROCESSES_ENV, "6")  # the node launcher: every node on this machine
    assert threads.local_processes() == 6
    assert threads.share(cores=12) == 2


def test_configure_sets_and_describes_the_figure(monkeypatch):
    monkeypatch.setenv(threads.LOCAL_PROCESSES_ENV, "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    c = threads.configure(1)
    assert torch.get_num_threads() == 1 and c.explicit and threads.current() is c
    assert c.summary.startswith("threads: 1 (--threads;")
    c = threads.configure(look_s=0.01)
    assert torch.get_num_threads() == c.threads and not c.explicit
    assert 1 <= c.threads <= threads.share()
    assert c.summary.startswith(f"threads: {c.threads} per process ({threads.usable_cores()} cores // 1 local process")
    if c.others is not None:  # /proc/stat is there: the load it saw is named
        assert "cores busy with other work" in c.summary
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        threads.configure(0)


class _FakeMeter:
    def __init__(self, values):
        self.values = iter(values)

    def others(self):
        return next(self.values)


def test_the_adapter_follows_other_work_after_two_agreeing_looks():
    choice = threads.ThreadChoice(4, False, cores=4, local=1, others=0.0, cap=None)
    torch.set_num_threads(4)
    a = threads.Adapter(choice, every_s=0.0)
    a._meter = _FakeMeter([3.0, 0.0, 3.0, 3.0, 3.0, 0.2, 0.1])
    assert a.step() is None                     # one busy look: a passing burst
    assert a.step() is None                     # quiet again
    assert a.step() is None and a.step() == "threads: 4 -> 1 (3.0 cores busy with other work)"
    assert torch.get_num_threads() == 1 and choice.threads == 1
    assert a.step() is None                     # still busy
    assert a.step() is None and a.step() == "threads: 1 -> 4 (0.1 cores busy with other work)"
    assert torch.get_num_threads() == 4 and len(choice.notes) == 2


def test_a_threads_figure_given_never_moves():
    choice = threads.ThreadChoice(2, True, cores=4, local=1, others=None, cap=None)
    a = threads.Adapter(choice, every_s=0.0)
    assert not a.active and a.step() is None
    assert not threads.Adapter(None).active  # configure was not called: nothing to follow
