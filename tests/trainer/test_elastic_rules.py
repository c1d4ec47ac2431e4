"""The node launcher's decisions with tiny stand-in workers (one node, no training): fatal exit codes
stop the job without a restart, ordinary failures restart until the limit, and bad input is one
line and exit 2 before any rendezvous."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import fault
from trainer.launch import main as launch_main, parse_nnodes, parse_rdzv_conf, read_events

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, code: str, *launcher: str) -> tuple[int, list[dict]]:
    script = tmp_path / "worker.py"
    script.write_text(code)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.launch", "--local-nodes", "1", "--nnodes", "1", "--monitor-interval", "0.2",
           "--entry", str(script), "--timeout", "120", "--out", str(out), *launcher, "--"]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    return p.returncode, read_events(out)


def test_fatal_exit_codes_are_not_retried(tmp_path: Path) -> None:
    code, ev = _run(tmp_path, f"import sys; sys.exit({fault.EXIT_CHECKPOINT_FAILURE})", "--max-restarts", "3")
    assert code == fault.EXIT_CHECKPOINT_FAILURE
    kinds = [e["event"] for e in ev]
    assert kinds == ["node_start", "round", "failure", "give_up"], kinds
    assert "not retried" in ev[-1]["reason"]


def test_restart_limit(tmp_path: Path) -> None:
    code, ev = _run(tmp_path, "import sys; sys.exit(3)", "--max-restarts", "1")
    assert code == 1
    kinds = [e["event"] for e in ev]
    assert kinds.count("round") == 2 and kinds.count("failure") == 2 and kinds.count("restart") == 1, kinds
    assert "restart limit 1 reached" in ev[-1]["reason"]


def test_a_worker_whose_agent_dies_exits(tmp_path: Path) -> None:
    """The watchdog ends a worker orphaned by its agent (torch starts workers in their own session)."""
    child = tmp_path / "child.py"
    child.write_text(
        "import os, sys, time; sys.path.insert(0, %r)\n"
        "os.environ.update(TRAINER_HEARTBEAT_TIMEOUT='60', TRAINER_WATCH_PARENT='1')\n"
        "from trainer.fault import Heartbeat\nhb = Heartbeat(%r, 0)\nprint('ready', flush=True)\ntime.sleep(60)\n"
        % (str(REPO), str(tmp_path)))
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; p = subprocess.Popen([sys.executable, %r], "
                               "start_new_session=True, stdout=sys.stdout); print(p.pid, flush=True); time.sleep(60)"
                               % str(child)], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"
    parent.kill()
    parent.wait()
    import time
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("the orphaned worker kept running")


@pytest.mark.parametrize("text,ok", [("2", (2, 2)), ("3:3", (3, 3)), ("1:2", None), ("x", None), ("0", None)])
def test_parse_nnodes(text: str, ok) -> None:
    if ok is None:
        with pytest.raises(ValueError):
            parse_nnodes(text)
    else:
        assert parse_nnodes(text) == ok


def test_parse_rdzv_conf() -> None:
    conf = parse_rdzv_conf("join_timeout=30, is_host=0")
    assert conf["join_timeout"] == "30" and conf["is_host"] == "0" and conf["keep_alive_interval"] == "1"
    with pytest.raises(ValueError):
        parse_rdzv_conf("join_timeout")


def test_launcher_cli_errors(tmp_path: Path, capsys) -> None:
    assert launch_main(["--nnodes", "1:2", "--out", str(tmp_path), "--"]) == 2
    assert "fixed size" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("")
    assert launch_main(["--out", str(f / "sub"), "--"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(f / "sub") in err and "regular file" in err
    with pytest.raises(SystemExit):
        launch_main(["--nnodes", "1", "--"])  # no --out anywhere
