"""Fault soak: one multi-node job on this machine under a schedule of faults, with figures and a
timeline.

    python -m fastmoe_trainer.ft.soak --out out/ft_soak [--minutes 8] [--steps N] [--interval 10]
                                      [--faults rank,node,hang,nan,slot,stop] [--heartbeat-timeout 5]

The job is started the way an operator starts it: a ``--serve-store`` process and node launchers
for ``--nnodes 2`` (one rank each) plus a spare, tiny-moe, a full checkpoint every ``--interval``
steps. It first runs uninterrupted (the reference), then again from scratch while the faults are
injected, one at a time, evenly over the steps (the next one once the job is back where it was):

``rank``   ``kill -9`` of rank 1's worker (its node launcher lives on);
``node``   ``kill -9`` of rank 1's whole node (launcher and worker);
``hang``   ``SIGSTOP`` of rank 1's worker (the watchdogs find it after ``--heartbeat-timeout`` s);
``nan``    non-finite loss and gradients on rank 1's node two steps later (``TRAINER_INJECT_NAN``);
``slot``   the newest checkpoint slot damaged, then ``kill -9`` of rank 0's worker: the resume skips
           the slot for the older one;
``stop``   SIGTERM to every node launcher (a scheduler's preemption), then the same job started
           again (a new store and launchers).

A node that leaves (killed, or blamed for the NaN or the hang) is replaced by a new node launcher,
as a repaired node would join a cluster job: the job keeps one spare. ``--minutes`` sizes the run:
the reference's first steps measure the step time (``--steps`` sets it instead).

Reported per fault: the step reached, the step the job resumed from (steps redone), the seconds
from the fault to the first step completed by a new process, and to the job being back at the step
it had reached (wall lost); for the run: faults survived, goodput (the time the completed steps
took without the faults over the wall time: the soak's wall time less the wall lost, over it; the
reference's wall time over the soak's is printed beside, a ratio a shared machine's changing load
blurs), and whether the final weights and optimizer state equal the reference's bit for bit. Writes ``OUT/ft_soak.json``,
``OUT/ft_soak_timeline.png`` (step against time, faults marked) and prints Markdown tables
(docs/fault.md quotes them).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..checkpoint.dcp_io import dcp_load, storage_reader
from ..checkpoint.slots import latest_valid
from . import fault

FAULT_KINDS = ("rank", "node", "hang", "nan", "slot", "stop")
DESCRIPTION = {"rank": "`kill -9` of a rank", "node": "`kill -9` of a node", "hang": "`SIGSTOP` of a rank",
               "nan": "NaN on one node", "slot": "newest checkpoint slot damaged (+ `kill -9` of a rank)",
               "stop": "SIGTERM to every launcher, then a restart"}
TRAINER = ["--preset", "tiny-moe", "--peak-tflops", "1", "--no-logging.progress", "--no-logging.plot",
           "--no-logging.tensorboard", "--no-eval.enabled"]


class Job:
    """A store process and node launchers for one job on this machine; nodes can be added (a new
    spare) and the whole job started again on the same output directory."""

    def __init__(self, out: Path, steps: int, interval: int, heartbeat_timeout: float, env: dict[str, str]) -> None:
        self.out, self.env = out, env
        self.trainer = [*TRAINER, "--steps", str(steps), "--checkpoint.interval", str(interval),
                        "--data.cache_dir", str(out.parent / "data_cache")]
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.store: subprocess.Popen | None = None
        self.endpoint = ""
        self.started = 0.0  # when the job was (last) started
        self._next = 0

    def start(self, nodes: int) -> None:
        """A new store and ``nodes`` node launchers (the first start, or a restart after a stop), started
        together as docs/fault.md's batch scripts start them (the store in the background; a launcher
        waits for it, up to its ``read_timeout``)."""
        from .elastic.local_nodes import free_port

        self.started = time.time()
        self.endpoint = f"127.0.0.1:{free_port()}"
        ready = self.out / f".store-{time.time_ns()}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = subprocess.Popen([sys.executable, "-m", _pkg("launch"), "--serve-store", self.endpoint, "--out",
                                       str(ready)], env=self.env, stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(nodes):
            self.add_node()
        deadline = time.time() + 60
        while not ready.exists():
            if self.store.poll() is not None or time.time() > deadline:
                raise RuntimeError("the rendezvous store did not start")
            time.sleep(0.05)
        ready.unlink()

    def add_node(self) -> str:
        label = f"n{self._next}"
        self._next += 1
        cmd = [sys.executable, "-m", _pkg("launch"), "--node-label", label, "--rdzv-endpoint", self.endpoint,
               "--nnodes", "2", "--rdzv-conf", "is_host=0", "--max-restarts", "20", "--heartbeat-timeout",
               str(self.heartbeat_timeout), "--out", str(self.out), "--", *self.trainer]
        log = open(self.out / f"launcher-{label}.log", "w")
        self.nodes[label] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        return label

    def poll(self) -> list[tuple[str, int]]:
        """Node launchers that exited since the last call, with their codes."""
        ended = []
        for label, p in self.nodes.items():
            if label not in self.codes and p.poll() is not None:
                self.codes[label] = p.returncode
                ended.append((label, p.returncode))
        return ended

    def running(self) -> list[str]:
        return [label for label, p in self.nodes.items() if p.poll() is None]

    def kill_node(self, label: str) -> None:
        from .elastic.local_nodes import descendants

        p = self.nodes[label]
        for pid in [p.pid, *descendants(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for label in self.running():
            self.kill_node(label)
        if self.store is not None and self.store.poll() is None:
            self.store.kill()
            self.store.wait(timeout=30)


def _pkg(module: str) -> str:
    return f"{__package__}.{module}"


def _rank(out: Path, rank: int) -> dict[str, Any] | None:
    return fault.read_heartbeats(out).get(rank)


def run(out: Path, *, steps: int, interval: int, kinds: list[str], heartbeat_timeout: float,
        limit: float) -> dict[str, Any]:
    """One job to ``steps`` steps with ``kinds`` injected in order (none: the reference)."""
    nan_spec = out / "nan.spec"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[fault.NAN_ENV] = f"@{nan_spec}"
    job = Job(out, steps, interval, heartbeat_timeout, env)
    timeline: list[tuple[float, int]] = []  # (seconds since the start, steps completed), rank 0
    faults: list[dict[str, Any]] = []
    triggers = [steps * (i + 1) // (len(kinds) + 1) for i in range(len(kinds))]
    t_start = time.time()
    deadline = t_start + limit
    job.start(3)
    done, last = 0, -1
    lost_nodes: set[str] = set()
    stopping = False
    try:
        while time.time() < deadline:
            beat = _rank(out, 0)
            if beat is not None and beat["step"] != last:  # steps completed, whatever the phase
                last = beat["step"]
                timeline.append((time.time() - t_start, last))
                done = last
            for f in faults:  # recovery of the faults injected so far
                fired = out / "nan.fired"
                if f["kind"] == "nan" and not f.get("fired") and fired.exists():
                    f["fired"] = True  # the fault is when the NaN happened, not when it was armed
                    f["t"], f["t_rel"] = fired.stat().st_mtime, fired.stat().st_mtime - t_start
                    f["step"] = f["nan_step"]
                if f["kind"] == "nan" and not f.get("fired"):
                    continue
                if f.get("first_new_t") is None:
                    first = fault.first_new_step(out, f["t"])
                    if first is not None:
                        f["first_new_t"] = first
                if f.get("back_t") is None and f.get("first_new_t") is not None and beat is not None \
                        and float(beat.get("started", 0)) > f["t"] and beat["step"] >= f["step"]:
                    f["back_t"] = time.time()
                    f["resumed_from"] = int(beat["step"]) - int(beat.get("new_steps", 0))
            for label, code in job.poll():
                if stopping:
                    continue
                events = [e for e in _events(out) if e["time"] >= job.started]
                if any(e["event"] in ("finished", "job_end") for e in events):
                    continue  # the job ended: nothing to replace
                if label in lost_nodes or code in (fault.EXIT_SOFT_FAILURE, 77):
                    job.add_node()  # a repaired node joins as the new spare
            if not job.running() and not stopping:
                break
            ready = not faults or faults[-1].get("back_t") is not None
            if kinds and ready and done >= triggers[0] and done < steps - 2:
                kind = kinds.pop(0)
                triggers.pop(0)
                f = inject(kind, job, out, nan_spec, done, lost_nodes)
                f["t_rel"] = f["t"] - t_start
                faults.append(f)
                if kind == "stop":
                    stopping = True
                    codes = _wait_all(job, 120)
                    f["stop_s"] = round(time.time() - f["t"], 1)  # the signal to the last launcher's exit
                    f["stop_codes"] = {label: codes.get(label) for label in f["signalled"]}
                    f["stopped_at"] = _stopped_step(out)
                    job.store.kill()
                    job.store.wait(timeout=30)
                    job.start(3)  # the same job again: a new store and node launchers, same --out
                    stopping = False
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the job did not end within {limit:.0f}s; see {out}/launcher-*.log")
    finally:
        job.close()
    wall = time.time() - t_start
    finished = any(e["event"] == "finished" for e in _events(out))
    return {"wall_s": wall, "finished": finished, "timeline": timeline, "faults": faults, "codes": job.codes,
            "steps": steps, "interval": interval}


def inject(kind: str, job: Job, out: Path, nan_spec: Path, done: int, lost_nodes: set[str]) -> dict[str, Any]:
    b1, b0 = _rank(out, 1), _rank(out, 0)
    f: dict[str, Any] = {"kind": kind, "step": done, "t": time.time()}
    if kind == "rank":
        os.kill(b1["pid"], signal.SIGKILL)
    elif kind == "node":
        lost_nodes.add(b1["host"])
        job.kill_node(b1["host"])
    elif kind == "hang":
        os.kill(b1["pid"], signal.SIGSTOP)
    elif kind == "nan":
        f["nan_step"] = int(b1["step"]) + 2
        nan_spec.write_text(f"step={f['nan_step']},host={b1['host']},once={out / 'nan.fired'}\n")
    elif kind == "slot":
        newest = latest_valid(out / "checkpoints")
        f["damaged"] = str(newest.path) if newest else None
        if newest is not None:
            with open(Path(newest.path) / "meta.json", "a") as fh:
                fh.write(" ")  # its size and sha256 no longer match the manifest
        os.kill(b0["pid"], signal.SIGKILL)
    elif kind == "stop":
        f["signalled"] = job.running()
        for label in f["signalled"]:
            os.kill(job.nodes[label].pid, signal.SIGTERM)
    else:
        raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
    return f


def _events(out: Path) -> list[dict[str, Any]]:
    from .elastic.job import read_events

    return read_events(out)


def _wait_all(job: Job, timeout: float) -> dict[str, int]:
    end = time.time() + timeout
    for label, p in job.nodes.items():
        if p.poll() is None:
            try:
                p.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                job.kill_node(label)
                p.wait()
    job.poll()
    return dict(job.codes)


def _stopped_step(out: Path) -> int | None:
    ends = [e for e in _events(out) if e["event"] == "job_end" and str(e.get("line", "")).startswith("stopped at")]
    return int(ends[-1]["line"].split()[3]) if ends else None


def read_state(path: Path) -> dict[str, Any]:
    """Every tensor of a full checkpoint, read in this process (no process group)."""
    import torch

    md = storage_reader(path).read_metadata().state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
            if hasattr(m, "size")}
    dcp_load(want, path)
    return want


def same_state(a: Path, b: Path) -> tuple[bool, int, list[str]]:
    import torch

    sa, sb = read_state(a), read_state(b)
    differ = sorted(k for k in sa.keys() | sb.keys() if k not in sa or k not in sb or not torch.equal(sa[k], sb[k]))
    return not differ, len(sa), differ[:5]


def _final(out: Path, steps: int) -> Path | None:
    info = latest_valid(out / "checkpoints")
    return Path(info.path) if info is not None and info.step == steps else None


def summarize(ref: dict[str, Any], soak: dict[str, Any]) -> dict[str, Any]:
    tl = [p for p in ref["timeline"] if p[1] > 0]  # from the first step on: start-up left out
    step_s = (tl[-1][0] - tl[0][0]) / (tl[-1][1] - tl[0][1]) if len(tl) > 1 and tl[-1][1] > tl[0][1] \
        else float("nan")
    rows = []
    for f in soak["faults"]:
        first, back = f.get("first_new_t"), f.get("back_t")
        resumed = f.get("resumed_from")
        redone = None if resumed is None else max(0, f["step"] - resumed)
        lost = None if back is None else back - f["t"]
        rows.append({"kind": f["kind"], "at_s": round(f["t_rel"], 1), "step": f["step"], "resumed_from": resumed,
                     "redone": redone, "first_new_step_s": None if first is None else round(first - f["t"], 1),
                     "lost_s": None if lost is None else round(lost, 1),
                     "lost_beyond_redone_s": None if lost is None or redone is None else
                     round(lost - redone * step_s, 1),
                     "survived": back is not None,
                     **({"stop_codes": f["stop_codes"], "stopped_at": f["stopped_at"], "stop_s": f["stop_s"]}
                        if f["kind"] == "stop" else {})})
    lost = sum(r["lost_s"] or 0.0 for r in rows)
    # goodput from the soak's own clock: the time its completed steps took without the faults is
    # its wall time less what each fault cost until the job was back where it was. (The
    # reference's wall time over the soak's says the same when the machine's load is steady; on a
    # shared machine the two runs see different loads, so it is given beside, not used.)
    return {"step_s": step_s, "goodput": (soak["wall_s"] - lost) / soak["wall_s"], "lost_s": lost,
            "reference_over_soak": ref["wall_s"] / soak["wall_s"], "rows": rows,
            "survived": sum(r["survived"] for r in rows), "faults": len(rows)}


def plot(ref: dict[str, Any], soak: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for res, style, label in ((ref, dict(color="0.6", ls="--"), "uninterrupted"),
                              (soak, dict(color="C0"), "under faults")):
        t = [p[0] for p in res["timeline"]]
        s = [p[1] for p in res["timeline"]]
        ax.step(t, s, where="post", label=label, **style)
    colors = {k: f"C{i + 1}" for i, k in enumerate(FAULT_KINDS)}
    ymax = soak["steps"]
    for f in soak["faults"]:
        ax.axvline(f["t_rel"], color=colors[f["kind"]], lw=1.2)
        ax.text(f["t_rel"], ymax * 1.02, f["kind"], rotation=90, va="bottom", ha="center", fontsize=8,
                color=colors[f["kind"]])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("steps completed (rank 0)")
    ax.set_ylim(0, ymax * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary: dict[str, Any], ref: dict[str, Any], soak: dict[str, Any], same: bool, tensors: int) -> str:
    lines = ["| fault | at (s) | step | resumed from | steps redone | first new step (s) | wall lost (s) | "
             "lost beyond the redone steps (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {DESCRIPTION[r['kind']]} | {r['at_s']} | {r['step']} | {r['resumed_from']} | {r['redone']} | "
                     f"{r['first_new_step_s']} | {r['lost_s']} | {r['lost_beyond_redone_s']} |")
    stops = [r for r in summary["rows"] if r["kind"] == "stop"]
    for r in stops:
        lines.append("")
        lines.append(f"The stop: every launcher out {r['stop_s']} s after SIGTERM (exit codes "
                     f"{sorted(set(r['stop_codes'].values()))}), stopped at step {r['stopped_at']}; the rest of its "
                     "wall lost is the new job's start-up")
    lines.append("")
    lines.append(f"{summary['survived']} of {summary['faults']} faults survived; {soak['steps']} steps, a checkpoint "
                 f"every {soak['interval']}; step time {summary['step_s']:.2f} s; under faults {soak['wall_s']:.0f} s "
                 f"of which {summary['lost_s']:.0f} s lost to them: goodput {summary['goodput']:.2f} (the "
                 f"uninterrupted run took {ref['wall_s']:.0f} s: {summary['reference_over_soak']:.2f} of the soak's "
                 f"wall time); final weights and optimizer state {'bit-identical' if same else 'DIFFERENT'} "
                 f"({tensors} tensors)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastmoe_trainer.ft.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/ft_soak")
    ap.add_argument("--minutes", type=float, default=6.0, help="about how long the uninterrupted run takes")
    ap.add_argument("--steps", type=int, default=None, help="steps of the job (instead of --minutes)")
    ap.add_argument("--interval", type=int, default=10, help="full checkpoint every this many steps")
    ap.add_argument("--faults", default=",".join(FAULT_KINDS), help=f"in order, from {','.join(FAULT_KINDS)}")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0, help="watchdog limit (the hang fault)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad:
        print(f"error: unknown fault(s) {bad}; choose from {','.join(FAULT_KINDS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps
    if steps is not None and steps % args.interval:
        print(f"error: --steps {steps} must be a multiple of --interval {args.interval} (the final state is "
              "compared through the checkpoint of the last step)", file=sys.stderr)
        return 2
    if steps is None:  # the step time of this machine, from a short uninterrupted job
        cal = run(out / "calibration", steps=20, interval=args.interval, kinds=[],
                  heartbeat_timeout=args.heartbeat_timeout, limit=900)
        tl = cal["timeline"]
        rate = (tl[-1][1] - tl[0][1]) / max(tl[-1][0] - tl[0][0], 1e-9)
        steps = max(args.interval * (len(kinds) + 2), int(rate * 60 * args.minutes) // args.interval * args.interval)
        print(f"calibration: {rate:.2f} steps/s; {steps} steps for about {args.minutes} minutes", flush=True)
    limit = 3600 * 3
    ref = run(out / "reference", steps=steps, interval=args.interval, kinds=[],
              heartbeat_timeout=args.heartbeat_timeout, limit=limit)
    print(f"reference: {steps} steps in {ref['wall_s']:.0f} s", flush=True)
    soak = run(out / "soak", steps=steps, interval=args.interval, kinds=list(kinds),
               heartbeat_timeout=args.heartbeat_timeout, limit=limit)
    a, b = _final(out / "reference", steps), _final(out / "soak", steps)
    same, tensors, differ = same_state(a, b) if a is not None and b is not None else (False, 0, ["no final checkpoint"])
    summary = summarize(ref, soak)
    title = (f"tiny-moe, 2 nodes + a spare, {steps} steps, a checkpoint every {args.interval}: goodput "
             f"{summary['goodput']:.2f}, final state {'bit-identical' if same else 'different'}")
    plot(ref, soak, out / "ft_soak_timeline.png", title)
    result = {"steps": steps, "interval": args.interval, "reference": ref, "soak": soak, "summary": summary,
              "bit_identical": same, "tensors": tensors, "differ": differ}
    (out / "ft_soak.json").write_text(json.dumps(result, indent=2, default=str))
    print(markdown(summary, ref, soak, same, tensors), flush=True)
    print(f"timeline: {out / 'ft_soak_timeline.png'}", flush=True)
    return 0 if same and summary["survived"] == summary["faults"] and soak["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
