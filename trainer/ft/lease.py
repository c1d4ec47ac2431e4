"""One writer per output directory: the lease.

Every command that writes an output directory (``fastmoe-train``'s ``--out``, ``fastmoe-export``'s
and ``fastmoe-preprocess``'s ``--out``) takes a lease on it before any work. The lease is a file,
``OUT/lease.json`` for a run directory (``.NAME.lease`` beside an output that is replaced whole,
as an export is), naming the holder: host, process id, the job (a scheduler's job id, torch's
elastic run id, the launcher's job), when it was taken, and a heartbeat the holder refreshes every
:data:`REFRESH_S` seconds. The holder also keeps an ``flock`` on it where the file system honours
one; where it does not (many Lustre mounts), the heartbeat alone tells a live holder from a gone one.

A second job meets the lease and is refused before any work, in one line naming the holder and the
ways on (exit 2). A lease whose holder is gone (on this host with its process dead, or with a
heartbeat older than :func:`stale_after` seconds) is taken over with one line saying so, so a job
requeued after a preemption or a crash resumes with no manual step.

All processes of one job share one lease: the launcher, or the job's rank 0, takes it, and every
process whose job is the holder's goes on (:func:`job_id`: ``fastmoe-launch`` and ``fastmoe-train
--nproc-per-node`` name the job for their workers in :data:`JOB_ENV`; under ``torchrun`` the
elastic run id, the same for the workers of every restart). Standard library only.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..config.errors import ConfigError

#: The lease file of a run directory.
LEASE_FILE = "lease.json"
#: Set by the launchers for their workers: the job they belong to (the lease's holder shares with them).
JOB_ENV = "FASTMOE_LEASE_JOB"
#: Seconds after which a lease whose heartbeat was not refreshed counts as abandoned (default 60).
STALE_ENV = "FASTMOE_LEASE_STALE_S"
#: How often the holder refreshes the heartbeat (a fraction of the default bound).
REFRESH_S = 10.0
_SIZE = 1024  # the record, padded: one pwrite of a fixed size rewrites it in place (no torn read of a shorter one)
#: The scheduler variables that name a job, in the order they are looked for.
_SCHEDULER_IDS = (("slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")), ("pbs", ("PBS_JOBID",)),
                  ("lsf", ("LSB_JOBID", "LSB_JOBINDEX")), ("flux", ("FLUX_JOB_ID",)))


class LeaseHeld(ConfigError):
    """Another live job holds the lease; the message names it and the ways on."""


def stale_after() -> float:
    try:
        return max(float(os.environ.get(STALE_ENV, "60")), 1.0)
    except ValueError:
        return 60.0


def host() -> str:
    return os.environ.get("TRAINER_HOST") or socket.gethostname()


def job_id() -> str:
    """This process's job, the same for every process of one launcher job and for the workers of
    its restarts: the launcher's (:data:`JOB_ENV`), else the scheduler's job (and step, and requeue
    count) with torch's elastic run id, else this process alone."""
    given = os.environ.get(JOB_ENV)
    if given:
        return given
    parts = []
    for name, keys in _SCHEDULER_IDS:
        if os.environ.get(keys[0]):
            parts.append(f"{name}:" + ".".join(os.environ.get(k, "") for k in keys))
            break
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        # a static rendezvous names every job "none": its store's address tells two apart
        where = f"@{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}" if run_id == "none" else ""
        parts.append(f"torchrun:{run_id}{where}")
    return "+".join(parts) or f"process:{host()}:{os.getpid()}"


def launcher_job(prefix: str, *, shared: bool) -> str:
    """The job id a launcher gives its workers (:data:`JOB_ENV`): one it was given itself, else
    ``prefix`` with the scheduler's job; without a scheduler, ``prefix`` alone when every node's
    launcher of the job computes the same one (``shared``: a rendezvous id and endpoint), else
    ``prefix`` made unique to this launcher."""
    base = job_id()
    if os.environ.get(JOB_ENV):
        return base
    if not base.startswith("process:"):
        return f"{prefix}+{base}"
    return prefix if shared else f"{prefix}:{host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def launcher_lease(out: str | os.PathLike, *, command: str, prefix: str, shared: bool) -> "Lease | None":
    """A launcher's lease on the run directory ``out`` (which exists), for its job, which its
    workers then join (:data:`JOB_ENV` is set for them)."""
    os.environ[JOB_ENV] = launcher_job(prefix, shared=shared)
    return take_lease(lease_path(out), what=f"--out {out}", command=command)


def lease_path(out: str | os.PathLike, *, beside: bool = False) -> Path:
    """The lease file of ``out``: inside it, or (``beside``: an output replaced whole) next to it."""
    p = Path(out)
    return p.parent / f".{p.name}.lease" if beside else p / LEASE_FILE


def _read(path: Path) -> dict[str, Any] | None:
    for _ in range(5):  # a record being rewritten: read again
        try:
            text = path.read_bytes().decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        if not text:
            return None
        try:
            rec = json.loads(text)
            return rec if isinstance(rec, dict) else None
        except ValueError:
            time.sleep(0.01)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age(rec: dict[str, Any], path: Path) -> float:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return time.time() - max(float(rec.get("refreshed", 0.0) or 0.0), mtime)


def _describe(rec: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("started", 0.0) or 0.0)))
    job = rec.get("job", "")
    job_part = f", job {job}" if job and not str(job).startswith("process:") else ""
    return f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}{job_part}, {rec.get('command', 'a command')}, " \
           f"started {started}"


class Lease:
    """A lease this process holds: its file, kept locked, and the thread that refreshes it."""

    def __init__(self, path: Path, fd: int, record: dict[str, Any], found: os.stat_result | None = None) -> None:
        self.path, self.fd, self.record = path, fd, record
        # the directory's times before the lease file was made there, and after: a holder that changed
        # nothing else leaves them as it found them (a refused command changes nothing)
        self._found = found
        self._made = path.parent.stat() if found is not None else None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="lease-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _write(self) -> None:
        self.record["refreshed"] = time.time()
        data = json.dumps(self.record).encode()
        os.pwrite(self.fd, data + b" " * max(_SIZE - len(data), 0), 0)

    def _refresh(self) -> None:
        while not self._done.wait(REFRESH_S):
            try:
                self._write()
            except OSError:
                pass  # a full disk for a moment: the next refresh tries again (the bound is six of them)

    def release(self) -> None:
        """Give the lease up (the file is removed: the directory is as the holder found it)."""
        if self._done.is_set():
            return
        self._done.set()
        _HELD.pop(str(self.path), None)
        rec = _read(self.path)
        try:
            if rec is not None and rec.get("token") == self.record["token"]:
                now = self.path.parent.stat()
                self.path.unlink()
                if self._found is not None and self._made is not None and \
                        (now.st_mtime_ns, now.st_nlink) == (self._made.st_mtime_ns, self._made.st_nlink):
                    os.utime(self.path.parent, ns=(self._found.st_atime_ns, self._found.st_mtime_ns))
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def take_output_lease(out: str | os.PathLike, *, command: str) -> Lease | None:
    """The lease of an output written whole beside ``out`` and moved there (an export, a data set):
    the file ``.NAME.lease`` next to it, its parent made when missing (the command's checks passed)."""
    path = lease_path(out, beside=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file (/dev/null/x) exists, but not as a directory
        reason = os.strerror(errno.ENOTDIR) if isinstance(e, FileExistsError) else e.strerror or e
        raise ConfigError(f"cannot create --out {out}: {reason}") from None
    return take_lease(path, what=f"--out {out}", command=command)


#: The leases this process holds, by path: a second taker in this process shares the first's.
_HELD: dict[str, Lease] = {}


def take_lease(path: str | os.PathLike, *, what: str, command: str) -> Lease | None:
    """Take the lease ``path`` for this process's job, or join it when the job already holds it.

    ``what`` names the directory in the messages (``--out OUT``); ``command`` is recorded for the
    next taker's line. Returns the lease taken (None when joined); raises :class:`LeaseHeld` when
    another live job holds it. The directory holding ``path`` must exist."""
    path = Path(os.path.abspath(path))
    if str(path) in _HELD:
        return None
    job = job_id()
    rec = _read(path)
    if rec is not None and rec.get("job") == job:
        return None  # this job's lease (a restarted worker group, an earlier Trainer in this process)
    try:
        found = path.parent.stat() if not path.exists() else None
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write its lease {path}: {e.strerror or e}") from None
    locked: bool | None = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            rec = _read(path) or rec or {}
            if rec.get("job") == job:
                return None
            raise _held(rec, path, what) from None
        locked = None  # no flock here (ENOLCK, EOPNOTSUPP...): the heartbeat decides
    rec = _read(path)
    if rec is not None and rec.get("job") != job and _live(rec, path, locked=locked):
        os.close(fd)
        raise _held(rec, path, what)
    if rec is not None and rec.get("job") != job:
        gone = ("its process is gone" if rec.get("host") == host() and not _alive(int(rec.get("pid", 0) or 0))
                else f"its heartbeat is {_age(rec, path):.0f} s old, over the {stale_after():.0f} s bound")
        print(f"{what}: taking over the lease of {_describe(rec)} ({gone})", flush=True)
    record = {"host": host(), "pid": os.getpid(), "job": job, "command": command, "started": time.time(),
              "token": uuid.uuid4().hex}
    lease = Lease(path, fd, record, found)
    try:
        lease._write()
    except OSError as e:
        lease.release()
        raise ConfigError(f"{what}: cannot write its lease {path}: {e.strerror or e}") from None
    if locked is None:  # no lock to settle a race: the last writer holds it, the other one sees so
        time.sleep(0.05)
        now = _read(path)
        if now is not None and now.get("token") != record["token"]:
            lease._done.set()
            os.close(fd)
            raise _held(now, path, what)
    _HELD[str(path)] = lease
    return lease


def _live(rec: dict[str, Any], path: Path, *, locked: bool | None) -> bool:
    """Whether the holder ``rec`` still runs: on this host its process, elsewhere (or with no lock
    to tell) a heartbeat within the bound. ``locked``: this process got the flock (the holder's
    lock is gone where the file system honours one)."""
    pid = int(rec.get("pid", 0) or 0)
    if rec.get("host") == host():
        if not _alive(pid) or pid == os.getpid():
            return False
        if locked:  # alive, yet not holding the lock: the pid was reused, unless the heartbeat says otherwise
            return _age(rec, path) <= stale_after()
        return True
    return _age(rec, path) <= stale_after()


def _held(rec: dict[str, Any], path: Path, what: str) -> LeaseHeld:
    age = _age(rec, path) if rec else float("nan")
    return LeaseHeld(f"{what} is in use by another job ({_describe(rec)}; heartbeat {age:.0f} s ago, {path}): "
                     f"wait for it to end or stop it, or give this one another {what.split()[0]}; a lease "
                     f"whose holder is gone (or silent for {stale_after():.0f} s) is taken over by the next run")
