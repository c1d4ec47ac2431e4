"""Runs one case: every provider, the GEMM-only bound and the dense ceiling, in interleaved rounds.

Each round calls every contestant once, starting one further along the list each round, so slow
drifts of a shared machine (other jobs, thermal state) land on all of them alike. Before the
rounds every contestant runs once untimed (a cold call: first-touch page faults, lazy init); the
providers' cold call also gives their outputs and gradients for the correctness check.

A provider whose cold call shows it may not fit ``rounds`` calls into ``budget_s`` is timed once
more, warm (a cold call can hold compiling and autotuning), and runs the rounds that warm call says
fit; one whose warm call alone exceeds the budget keeps that warm call as its only sample.
Both are flagged in the results (``budget_limited``) rather than stalling the run.

A call shorter than ``min_sample_s`` (a small layer's 0.1-0.5 ms) is timed as ``n`` calls in a row, its
sample their mean, ``n`` set from a warm call after the cold one so that a sample lasts about
``min_sample_s`` (``calls_per_sample`` in the results): one such call's time varies by more than the
differences the case is run to show. Longer calls are one call per sample.

Each timed call also counts the process's minor page faults (median per call in the results):
fresh memory the kernel maps page by page, the cost that separates implementations which
allocate their big buffers every step from those which do not, and a large part of the spread.
"""
from __future__ import annotations

import gc
import math
import sys
from typing import Callable

import torch

from .bounds import DenseCeiling, GemmBound
from .cases import Case
from .measure import capture_forward, compare, page_faults, peak_bytes, saved_bytes, stats, time_fn, timed_call
from .providers import REFERENCE, Provider, ProviderSkipped, build_provider
from .words import plural

CEILING = "dense_ceiling"
BOUND = "gemm_bound"
#: Calls shorter than this are timed several in a row, their mean one sample (seconds).
MIN_SAMPLE_S = 0.01
#: At most this many calls make one sample.
MAX_CALLS_PER_SAMPLE = 200


def _progress(total: int, desc: str, enabled: bool):
    if not enabled or not sys.stderr.isatty():  # in a log file a bar is thousands of redraws on one line
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, desc=desc, unit="call", file=sys.stderr, leave=False, dynamic_ncols=True)


def run_case(
    case: Case,
    provider_names: list[str],
    *,
    backward: bool = True,
    rounds: int = 5,
    budget_s: float = 60.0,
    ceiling_n: int = 4096,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: None,
    gemm_engine: str = "auto",
    build: Callable[[str, Case], Provider] | None = None,
    reference: str = REFERENCE,
    ceiling: DenseCeiling | None = None,
    min_sample_s: float = MIN_SAMPLE_S,
    reference_out: dict | None = None,
    inference: bool = False,
    cuda_graph: bool = False,
) -> dict:
    """Measure one case; returns a JSON-ready dict (times in seconds). ``gemm_engine``: stage 4's
    engine for the plain ``fastmoe/<backend>`` providers (``fastmoe/<backend>@<engine>`` name theirs).
    ``build`` makes a provider from its name (``bench --family`` passes its own; the default is
    :func:`build_provider` with ``gemm_engine``), ``reference`` names the one the others are checked
    against; ``ceiling``: the dense matmul to time beside them (default the ``ceiling_n`` square);
    ``min_sample_s``: contestants whose calls are shorter take the mean of several calls as one sample
    (0: always one call). ``reference_out``: outputs and gradients to check every provider against
    instead of a reference provider's (an fp32 reference computed apart, say). ``inference``: time
    forward calls under ``torch.no_grad`` (generation, evaluation), reported as mode ``infer``.
    ``cuda_graph`` (with ``inference``, on CUDA): each provider's forward is captured once in a CUDA
    graph and every timed call is a replay (decode as servers run it); a provider whose capture fails
    is timed eagerly, the reason in its note and ``cuda_graph`` false in its entry."""
    backward = backward and not inference
    if cuda_graph and (not inference or case.device.type != "cuda"):
        raise ValueError("CUDA graphs are captured for inference calls on a CUDA device: use --mode infer "
                         f"--device cuda (got {'--mode infer' if inference else 'a training step'} on "
                         f"{case.device.type})")
    result: dict = {"case": case.describe(), "providers": {}, "backward": backward, "rounds": rounds,
                    "budget_s": budget_s, "inference": inference, "cuda_graph": cuda_graph}
    providers: dict[str, Provider] = {}
    for name in provider_names:
        try:
            providers[name] = build(name, case) if build is not None else build_provider(name, case, gemm_engine)
        except ProviderSkipped as exc:
            result["providers"][name] = {"status": "skipped", "reason": str(exc)}
            log(f"  {name}: skipped: {exc}")

    ceiling = ceiling or DenseCeiling(ceiling_n, case.dtype, case.device)
    bound = GemmBound(case)
    dev = case.device

    # Contestants: name -> callable returning (forward_s, backward_s).
    def run_ceiling() -> tuple[float, float]:
        return time_fn(ceiling.run, dev), 0.0

    def run_bound() -> tuple[float, float]:
        f = time_fn(bound.forward, dev)
        b = time_fn(bound.backward, dev) if backward else 0.0
        return f, b

    graphs: dict[str, Callable[[], torch.Tensor]] = {}
    graph_failed: dict[str, str] = {}
    if cuda_graph:
        for name, prov in providers.items():
            try:
                graphs[name] = capture_forward(prov, case)
            except Exception as exc:  # reported: the provider is then timed eagerly
                graph_failed[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                log(f"  {name}: not capturable in a CUDA graph ({graph_failed[name]}); timed eagerly")
                torch.cuda.synchronize(case.device)

    contestants: dict[str, Callable[[], tuple[float, float]]] = {CEILING: run_ceiling, BOUND: run_bound}
    for name, prov in providers.items():
        contestants[name] = (lambda p, g: lambda: timed_call(p, case, backward=backward, grad=not inference,
                                                             graphed=g)[:2])(prov, graphs.get(name))

    allowed: dict[str, int] = {}
    calls: dict[str, int] = {}  # calls per sample
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in contestants}

    def calibrate(name: str, cold_s: float) -> None:
        """``calls[name]`` from one warm call when the cold call was shorter than a sample."""
        n = 1
        if cold_s < min_sample_s:
            f, b = contestants[name]()
            n = min(MAX_CALLS_PER_SAMPLE, max(1, math.ceil(min_sample_s / max(f + b, 1e-9))))
        calls[name] = n
    bar = _progress(len(contestants) * (rounds + 1), f"{case.preset.name}", progress)

    # Cold calls; the reference first so that each other provider is checked and its tensors freed.
    ref_out = reference_out
    order = [CEILING, BOUND] + sorted(providers, key=lambda n: n != reference)
    for name in order:
        if name in providers:
            prov = providers[name]
            f, b, got = timed_call(prov, case, backward=backward, capture=True, grad=not inference,
                                   graphed=graphs.get(name))
            entry = result["providers"][name] = {"status": "ok", "note": prov.note, "cold_s": f + b}
            if cuda_graph:
                entry["cuda_graph"] = name in graphs
                if name in graph_failed:
                    entry["note"] = f"{prov.note}; eager: its CUDA graph capture failed ({graph_failed[name]})"
            if name == reference and reference_out is None:
                ref_out = got
            if ref_out is not None:
                entry["correct"] = compare(got, ref_out, case.dtype, prov.precision)
            del got
            # under torch.no_grad nothing is kept for a backward
            entry["saved_bytes"] = 0 if inference else saved_bytes(prov, case)
            peak = peak_bytes(prov, case, backward=backward, grad=not inference)
            if peak is not None:
                entry["peak_bytes"] = peak
            cold = f + b
            if cold * rounds > budget_s:
                # A cold call can hold one-off work (compiling kernels, an autotuner's trials): the
                # rounds that fit are judged from a warm call, and a warm call is the sample kept
                # when not even one round fits.
                f, b = contestants[name]()
                cold = f + b
            n_ok = rounds if cold * rounds <= budget_s else int(budget_s // cold) if cold > 0 else rounds
            allowed[name] = n_ok
            if n_ok < rounds:
                entry["budget_limited"] = True
                if n_ok == 0:
                    samples[name].append((f, b))
                    entry["budget_note"] = (f"a warm call took {cold:.1f} s, over the {budget_s:.0f} s budget: "
                                            "it is the only sample")
                else:
                    entry["budget_note"] = f"{n_ok} of {plural(rounds, 'round')} fit the {budget_s:.0f} s budget"
                log(f"  {name}: {entry['budget_note']}")
            calibrate(name, cold)
        else:
            f, b = contestants[name]()
            allowed[name] = rounds
            calibrate(name, f + b)
        if bar is not None:
            bar.update(1)

    del ref_out
    names = list(contestants)
    faults: dict[str, list[int]] = {n: [] for n in contestants}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if r < allowed[name]:
                n = calls[name]
                f0 = page_faults()
                got = [contestants[name]() for _ in range(n)]
                if f0 is not None:
                    faults[name].append((page_faults() - f0) // n)
                samples[name].append((sum(f for f, _ in got) / n, sum(b for _, b in got) / n))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    def split(name: str) -> dict:
        s = samples[name]
        out = {"infer" if inference else "fwd": stats([f for f, _ in s])}
        if backward:
            out["bwd"] = stats([b for _, b in s])
            out["fwdbwd"] = stats([f + b for f, b in s])
        # Sample i was taken in round i (a kept cold call belongs to no round): same-round pairs
        # cancel load that changes more slowly than a round.
        pairable = allowed[name] > 0
        for mode, st in out.items():
            st["by_round"] = st.get("samples_s", []) if pairable else []
        return out

    def median_faults(name: str) -> int | None:
        f = sorted(faults[name])
        return f[len(f) // 2] if f else None

    result["ceiling"] = {"size": ceiling.n, "shape": list(ceiling.shape), "flops": ceiling.flops, **stats([f for f, _ in samples[CEILING]])}
    result["bound"] = split(BOUND)
    result["bound"]["page_faults_per_call"] = median_faults(BOUND)
    result["bound"]["calls_per_sample"] = calls[BOUND]
    for name, prov in providers.items():
        if prov.state is not None:
            state = prov.state()
            result["providers"][name]["auto"] = state
            if state["retimes"]:
                result["providers"][name]["auto_note"] = (
                    f"auto re-timed its engines {plural(state['retimes'], 'time')} in the "
                    f"{plural(state['forward_calls'], 'call')} it "
                    f"ran here ({'; '.join(state['history'])}); a sample holding a re-timing is slower than the "
                    "engine alone")
        result["providers"][name].update(split(name))
        result["providers"][name]["rounds"] = len(samples[name])
        result["providers"][name]["page_faults_per_call"] = median_faults(name)
        result["providers"][name]["calls_per_sample"] = calls[name]
    del providers, bound, ceiling
    gc.collect()
    return result
