"""The step-time model (trainer/scale/model.py), its cluster files, the formula profiles, the layout
search and the calibration: arithmetic checked on hand-computed cases."""
from __future__ import annotations

import re
import sys
import statistics
from pathlib import Path

import pytest

from trainer.parallelism.plan import GiB, make_plan
from trainer.scale import cluster as cl
from trainer.scale.formula import formula_profile, groups, stage_profiles
from trainer.scale.model import collective_seconds, compute_seconds, estimate, steps
from trainer.scale.model_cli import FIGURE4, figure4_check, main
from trainer.scale.profile import Collective, Compute, StepProfile, wire_bytes

ROOT = Path(__file__).resolve().parents[2]


def fig(v, kind="specification"):
    return {"value": v, "kind": kind, "source": "test"}


def toy_cluster(**over) -> cl.Cluster:
    """4 devices per node, 100 TFLOP/s bf16 at half efficiency, 1000 GB/s memory at 0.5, 5 us launches;
    10 GB/s and 1 us within a node, 2 NICs of 5 GB/s and 10 us between nodes; no FSDP overlap."""
    data = {"device": {"peak_tflops_bf16": fig(100.0), "peak_tflops_fp32": fig(10.0), "memory_gib": fig(16),
                       "memory_gbps": fig(1000.0), "gemm_efficiency": fig(0.5), "memory_efficiency": fig(0.5),
                       "launch_us": fig(5.0)},
            "node": {"devices_per_node": fig(4)},
            "intra": {"bandwidth_gbps": fig(10.0), "latency_us": fig(1.0)},
            "inter": {"nics_per_node": fig(2), "nic_gbps": fig(5.0), "latency_us": fig(10.0)},
            "overlap": {"fsdp": fig(False, "assumption")}}
    for key, v in over.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = v
    return cl.cluster_from_dict(data, "toy.toml")


# ----------------------------------------------------------------------------- collectives and compute
def test_collective_within_a_node_hand_computed():
    c = toy_cluster()
    ar = Collective("all_reduce", (0, 1, 2, 3), "fp32", 1_000_000)
    # wire 2 * 3/4 * 4e6 bytes at 10 GB/s; 2 * ceil(log2 4) = 4 steps of 1 us
    assert collective_seconds(ar, c) == pytest.approx(6e6 / 10e9 + 4e-6)
    a2a = Collective("all_to_all", (0, 1, 2, 3), "bf16", 1_000_000, count=3)
    assert collective_seconds(a2a, c) == pytest.approx(3 * (0.75 * 2e6 / 10e9 + 3e-6))
    assert collective_seconds(Collective("recv", (0, 1), "fp32", 10), c) == 0.0


def test_collective_across_nodes_shares_the_nics():
    c = toy_cluster()
    # one member per node: 2 NICs x 5 GB/s over 4 devices = 2.5 GB/s each, below the 10 GB/s link
    ag = Collective("all_gather", (0, 4), "fp32", 1_000_000)
    assert collective_seconds(ag, c) == pytest.approx(0.5 * 4e6 / 2.5e9 + 10e-6)
    # four members per node (two whole nodes): 10 GB/s of NICs per member, capped by the link's 10
    rs = Collective("reduce_scatter", tuple(range(8)), "fp32", 1_000_000)
    assert collective_seconds(rs, c) == pytest.approx(7 / 8 * 4e6 / 10e9 + 3 * 10e-6)
    send = Collective("send", (3, 4), "bf16", 500)
    assert collective_seconds(send, c) == pytest.approx(1000 / 2.5e9 + 10e-6)


def test_calibrated_op_figures_replace_the_link_within_a_node():
    c = toy_cluster(ops__all_gather={"bandwidth_gbps": fig(2.0, "measurement"), "latency_us": fig(50.0, "measurement")})
    ag = Collective("all_gather", (0, 1), "fp32", 1000)
    assert collective_seconds(ag, c) == pytest.approx(0.5 * 4000 / 2e9 + 50e-6)


def test_steps():
    assert [steps("all_reduce", w) for w in (1, 2, 4, 12)] == [0, 2, 4, 8]
    assert [steps("all_gather", w) for w in (2, 3, 12)] == [1, 2, 4]
    assert steps("all_to_all", 12) == 11 and steps("send", 99) == 1


def test_compute_hand_computed():
    c = toy_cluster()
    g = Compute("gemm", 1e12, 1e6, count=10)  # 1e12 FLOPs at 100 TFLOP/s x 0.5 = 20 ms; 10 launches of 5 us
    assert compute_seconds(g, c) == pytest.approx((0.02, 50e-6))
    m = Compute("memory", 0.0, 1e9, count=2)  # 1 GB at 1000 GB/s x 0.5 = 2 ms
    assert compute_seconds(m, c) == pytest.approx((2e-3, 10e-6))
    bound = Compute("gemm", 1.0, 1e9, dtype="fp32")  # bytes dominate a GEMM with no FLOPs to speak of
    assert compute_seconds(bound, c)[0] == pytest.approx(2e-3)
    assert compute_seconds(Compute("gemm", 1e11, 0.0, dtype="fp32"), c)[0] == pytest.approx(1e11 / 5e12)


def _profile(stage: int, gemm: float, *, pp: int = 2, M: int = 4, world: int = 2, extra=()) -> StepProfile:
    return StepProfile(rank=stage, world=world, source="formula", tokens_per_step=1000, micro_batches=M, pp=pp,
                       stage=stage, compute=[Compute("gemm", gemm, 0.0, count=0)], collectives=list(extra),
                       memory_bytes={"weights": 10 * (stage + 1)})


def test_estimate_1f1b_hand_computed():
    c = toy_cluster()
    # stage 0: 4 micro-batches of 10 ms each (2e12 FLOPs at 50 TFLOP/s = 40 ms); stage 1: 20 ms each
    p0, p1 = _profile(0, 2e12), _profile(1, 4e12)
    e = estimate({0: p0, 1: p1}, c)
    slot0, slot1 = 0.010, 0.020
    assert e.step_s == pytest.approx(3 * slot1 + slot0 + slot1)  # (M-1) x slowest + every stage's slot
    assert e.terms["bubble"] == pytest.approx(slot0 + slot1 - slot1)
    assert e.terms["gemm"] == pytest.approx(4 * slot1) and e.bottleneck_stage == 1
    assert e.memory_bytes == {"weights": 20}
    assert e.model_flops == pytest.approx(2e12 + 4e12)  # one rank per stage in a world of 2
    with pytest.raises(ValueError, match="stage"):
        estimate({0: p0}, c)
    # stage_counts: one profile standing for stages alike
    e3 = estimate({0: _profile(0, 2e12, pp=3, world=3), 1: _profile(1, 4e12, pp=3, world=3)}, c,
                  stage_counts={0: 1, 1: 2})
    assert e3.step_s == pytest.approx(3 * slot1 + slot0 + 2 * slot1)


def test_after_backward_and_fsdp_overlap():
    dp = Collective("reduce_scatter", (0, 1, 2, 3), "fp32", 1_000_000, label="optimizer")
    fs = Collective("all_gather", (0, 1, 2, 3), "fp32", 1_000_000, label="fsdp weights and gradients")
    prof = StepProfile(rank=0, world=4, source="formula", tokens_per_step=100, micro_batches=1, pp=1, stage=0,
                       compute=[Compute("gemm", 1e9, 0.0, count=0), Compute("memory", 0.0, 1e6, count=0, label="optimizer")],
                       collectives=[dp, fs])
    t_dp, t_fs = collective_seconds(dp, toy_cluster()), collective_seconds(fs, toy_cluster())
    t_gemm = 1e9 / 50e12
    e = estimate({0: prof}, toy_cluster())
    assert e.terms["dp sync"] == pytest.approx(t_dp) and e.terms["fsdp exposed"] == pytest.approx(t_fs)
    assert e.terms["optimizer step"] == pytest.approx(1e6 / 500e9)
    on = estimate({0: prof}, toy_cluster(overlap__fsdp=fig(True, "assumption")))
    assert on.terms["fsdp exposed"] == pytest.approx(max(0.0, t_fs - t_gemm))
    assert on.step_s < e.step_s


# ----------------------------------------------------------------------------- formula profiles
@pytest.mark.parametrize("optimizer,fsdp,pp,ep", [("sharded", False, 1, 4), ("epso", False, 2, 4),
                                                  ("adamw", False, 1, 2), ("epso", True, 2, 2)])
def test_formula_weight_traffic_equals_the_planner(optimizer, fsdp, pp, ep):
    plan = make_plan("mula-20b-a2b", world=96, pp=pp, ep=ep, ranks_per_node=12, optimizer=optimizer, global_batch=384)
    for rank in (0, plan.world - 1):
        prof = formula_profile(plan, rank, fsdp=fsdp)
        sent = sum(wire_bytes(c) for c in prof.collectives if c.label in ("optimizer", "fsdp weights and gradients"))
        st = plan.stages[prof.stage]
        assert sent == pytest.approx(plan.traffic_bytes(st, "fsdp" if fsdp else optimizer), rel=1e-9)


def test_formula_groups_follow_the_mesh():
    plan = make_plan("mula-20b-a2b", world=48, pp=2, ep=4, ranks_per_node=12, global_batch=384)
    g = groups(plan, 13)  # stage 0, dp 3, ep 1 (rank = (pp * DP + dp) * EP + ep, DP = 6)
    assert g["ep"] == (12, 13, 14, 15)
    assert g["dp"] == (1, 5, 9, 13, 17, 21)
    assert len(g["stage"]) == 24 and set(g["stage"]) == set(range(24))
    prof = formula_profile(plan, 13)
    sends = [c for c in prof.collectives if c.op == "send"]
    assert {c.group for c in sends} == {(13, 37)}  # to the same coordinates one stage on


def test_formula_ep_exchange_hand_computed():
    plan = make_plan("small-moe", world=4, ep=2, ranks_per_node=4, micro_batch=2, global_batch=8, context=64)
    prof = formula_profile(plan, 0)
    T, H, K, layers, M, a = 2 * 64, 128, 2, 4, plan.micro_batches, 2
    # per layer and micro-batch, allgather dispatch over 2 ranks, half of each gathered buffer leaves:
    # forward tokens, weights (bf16), indices (int32), partial outputs; backward their transposes
    per = 0.5 * (2 * T * H * a + 2 * T * K * a + 2 * T * K * 4 + 2 * T * H * a
                 + 2 * T * H * a + 2 * T * K * a + 2 * T * H * a)
    got = sum(wire_bytes(c) for c in prof.collectives if c.label == "ep tokens")
    assert got == pytest.approx(layers * M * per)
    ac = make_plan("small-moe", world=4, ep=2, ranks_per_node=4, micro_batch=2, global_batch=8, context=64, ac="moe")
    got_ac = sum(wire_bytes(c) for c in formula_profile(ac, 0).collectives if c.label == "ep tokens")
    # recomputed: the three gathers, not the partial outputs' reduce-scatter (checkpoint stops early)
    assert got_ac == pytest.approx(got + layers * M * 0.5 * (2 * T * H * a + 2 * T * K * a + 2 * T * K * 4))


def test_formula_flops_hand_computed_and_recompute():
    plan = make_plan("small-moe", world=1, micro_batch=2, global_batch=4, context=64)
    prof = formula_profile(plan, 0)
    T, H, Q, I, E, K, V, L, M = 128, 128, 128, 256, 16, 2, 258, 4, 2
    fwd = L * (8 * T * H * Q + 2 * T * H * E + 6 * T * K * H * I + 2 * 2 * 64 * 64 * Q) + 2 * T * H * V
    full = L * (3 * (8 * T * H * Q + 2 * T * H * E + 6 * T * K * H * I) + 3.5 * 2 * 2 * 64 * 64 * Q) + 3 * 2 * T * H * V
    got = sum(c.flops for c in prof.compute if c.kind != "memory")
    assert got == pytest.approx(M * full)
    ac = make_plan("small-moe", world=1, micro_batch=2, global_batch=4, context=64, ac="attn,moe")
    rec = sum(c.flops for c in formula_profile(ac, 0).compute if c.label.endswith("recompute"))
    assert rec == pytest.approx(M * (fwd - 2 * T * H * V))  # every forward but the LM head's, once more


@pytest.mark.parametrize("ac", ["", "moe"])
def test_formula_agrees_with_the_trace_on_a_small_layout(ac):
    from trainer.scale.trace import trace_profiles

    kw = dict(world=4, ep=2, micro_batch=2, global_batch=8, ac=ac)
    traced = trace_profiles("small-moe", optimizer="epso", ranks=[0], **kw)[0]
    plan = make_plan("small-moe", ranks_per_node=4, optimizer="epso", weights="bf16", **kw)
    formula = formula_profile(plan, 0, grad_bytes=4)  # the trainer reduces gradients in fp32
    for kind in ("gemm", "grouped_gemm"):
        t = sum(c.flops for c in traced.compute if c.kind == kind)
        f = sum(c.flops for c in formula.compute if c.kind == kind)
        assert f == pytest.approx(t, rel=0.01), kind

    def sent(p, label):
        return sum(wire_bytes(c) for c in p.collectives if c.phase == "step" and c.label == label)
    assert sent(formula, "optimizer") == pytest.approx(sent(traced, "optimizer"), rel=0.01)
    assert sent(formula, "ep tokens") == pytest.approx(sent(traced, "ep tokens"), rel=0.02)
    for k in ("weights", "gradients", "optimizer"):
        assert formula.memory_bytes[k] == pytest.approx(traced.memory_bytes[k], rel=0.01), k


# ----------------------------------------------------------------------------- cluster files
@pytest.mark.parametrize("name", cl.SHIPPED)
def test_shipped_cluster_files_load_through_the_package(name):
    text = cl.shipped_text(name)  # importlib.resources
    c = cl.load_cluster(name)
    assert c.name == name
    for key, f in c.figures.items():
        assert f.kind in cl.KINDS and len(f.source) > 10, key
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 reads them with the fallback parser
    assert cl.parse_small_toml(text) == tomllib.loads(text)  # the fallback parser reads what ships


def test_setup_ships_the_cluster_files():
    src = (ROOT / "setup.py").read_text()
    assert '"fastmoe_trainer.scale": ["clusters/*.toml"]' in src


def test_h200_efficiency_is_the_launch_table_median():
    """h200-dgx's GEMM and memory efficiencies are what launches.md measured (median over its shapes)."""
    text = (ROOT / "docs/bench_results/gpu-2026-11-27-h200/launches.md").read_text()
    gemm, mem = [], []
    for block in re.split(r"\n(?=\S+: T=\d+)", text):
        if "each launch timed" not in block:
            continue
        gf = gt = mb = mt = 0.0
        for line in block.split("each launch timed")[1].splitlines():
            cells = [x.strip() for x in line.split("|")]
            if len(cells) > 7 and cells[2] == "(pass)":
                ms, gb, gfl = float(cells[3]), float(cells[4]), float(cells[6])
                if gfl > 0:
                    gf, gt = gf + gfl, gt + ms
                else:
                    mb, mt = mb + gb, mt + ms
        gemm.append(gf / gt)
        mem.append(mb / mt * 1e3)
    h200 = cl.load_cluster("h200-dgx")
    assert len(gemm) == 6
    assert h200["device.gemm_efficiency"] == pytest.approx(statistics.median(gemm) / 989.4, abs=5e-4)
    assert h200["device.memory_efficiency"] == pytest.approx(statistics.median(mem) / 4800, abs=5e-4)
    assert h200.figures["device.gemm_efficiency"].kind == "measurement"


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_cluster_missing_figure_refused_in_one_line(tmp_path, capsys):
    text = cl.shipped_text("h100-dgx")
    bad = _write(tmp_path, "\n".join(l for l in text.splitlines() if not l.startswith("nic_gbps")))
    rc = main(["--preset", "mula-20b-a2b", "--world", "96", "--ep", "12", "--cluster", bad])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "inter.nic_gbps" in err and bad in err
    no_source = _write(tmp_path, re.sub(r'(\[intra\][^\[]*latency_us = \{ value = [\d.]+, kind = "assumption"), source = "[^"]*"',
                                        r"\1", text))
    with pytest.raises(cl.ClusterError, match="intra.latency_us has no source"):
        cl.load_cluster(no_source)
    with pytest.raises(cl.ClusterError, match="must be a positive number"):
        cl.load_cluster(_write(tmp_path, text.replace("value = 989.4", "value = 0")))
    with pytest.raises(cl.ClusterError, match="neither a shipped cluster"):
        cl.load_cluster(str(tmp_path / "absent.toml"))


def test_write_cluster_round_trip(tmp_path):
    path = str(tmp_path / "w.toml")
    sections = {s: {k: (1.0, "measurement", 'a "quoted" source') for k in keys} for s, keys in cl.REQUIRED.items()}
    sections["overlap"]["fsdp"] = (False, "assumption", "x")
    sections["ops.all_reduce"] = {"latency_us": (12.5, "measurement", "y"), "bandwidth_gbps": (0.5, "measurement", "y")}
    cl.write_cluster(path, "w", "test", sections)
    c = cl.load_cluster(path)
    assert c["ops.all_reduce.latency_us"] == 12.5 and c["overlap.fsdp"] is False
    assert c.figures["device.launch_us"].source == 'a "quoted" source'
    tomllib = pytest.importorskip("tomllib")
    assert cl.parse_small_toml(Path(path).read_text()) == tomllib.loads(Path(path).read_text())


# ----------------------------------------------------------------------------- the command, the checks, the search
def test_scaling_command_and_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = main(["--preset", "mula-220b-a10b", "--pp", "8", "--ep", "12", "--ac", "norm,attn,moe", "--cluster", "aurora",
               "--world", "384", "768", "1536", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    import json

    data = json.loads(out.read_text())
    worlds = data["worlds"]
    assert [w["world"] for w in worlds] == [384, 768, 1536]
    assert [w["global_batch"] for w in worlds] == [3072, 6144, 12288]  # weak scaling: the batch grows with DP
    assert worlds[0]["weak_scaling_efficiency"] == 1.0
    for w in worlds:
        assert sum(w["shares"].values()) == pytest.approx(1.0)
        assert w["tokens_per_s"] == pytest.approx(w["tokens_per_step"] / w["step_s"])
    assert len(data["figure4"]) == 2 and all(l.startswith(("PASS", "FAIL")) for l in data["figure4"])
    assert "Figure 4 weak-scaling efficiency at 768 tiles" in text


def test_figure4_check_bands():
    class A:
        preset, pp, world = FIGURE4["preset"], 8, [384, 768, 3072]

    class E:
        def __init__(self, w):
            self.world = w

    class C:
        name = "aurora"
    rows = [{"plan": type("P", (), {"ep": 12})(), "estimate": E(w), "efficiency": eff}
            for w, eff in ((384, 1.0), (768, 0.97), (3072, 0.99))]
    lines = figure4_check(A, C, rows)
    assert lines[0].startswith("PASS") and "768" in lines[0]
    assert lines[1].startswith("FAIL") and "3072" in lines[1] and "0.990" in lines[1]
    C.name = "h100-dgx"
    assert figure4_check(A, C, rows) == []


def test_search_returns_valid_layouts_within_memory():
    from trainer.scale.search import rank_memory, search

    c = cl.load_cluster("aurora")
    limit = 40 * GiB
    found, seen = search("mula-20b-a2b", 96, c, memory_bytes=limit, global_batch=384)
    assert seen > len(found) > 5
    times = [x.estimate.step_s / x.estimate.tokens_per_step for x in found]
    assert times == sorted(times)
    for x in found:
        p = x.plan
        assert p.pp * p.dp * p.ep == 96 and 96 % p.ep == 0 and 12 % p.ep == 0 and p.shape.num_experts % p.ep == 0
        assert x.memory == rank_memory(p, x.kind) <= limit
        assert p.micro_batches >= p.pp and p.global_batch == 384
    # the search's stage-deduplicated price equals pricing every stage
    best = found[0]
    full = estimate(stage_profiles(best.plan, fsdp=best.kind == "fsdp"), c)
    assert full.step_s == pytest.approx(best.estimate.step_s, rel=1e-9)


def test_search_command(capsys):
    rc = main(["--preset", "mula-220b-a10b", "--world", "3072", "--cluster", "aurora", "--search", "--memory-gib", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    assert len(re.findall(r"^\s+[1-5]  PP", out, re.M)) == 5
    assert "the paper's layout (PP 8 x EP 12" in out


def test_usage_errors_exit_2(capsys):
    assert main(["--preset", "mula-220b-a10b", "--world", "384", "--pp", "8", "--ep", "12"]) == 2
    assert "--cluster is required" in capsys.readouterr().err
    assert main(["--calibrate", "there", "--out", "x"]) == 2
    assert "only 'here'" in capsys.readouterr().err
    assert main(["--preset", "mula-220b-a10b", "--world", "100", "--pp", "8", "--ep", "12", "--cluster", "aurora"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_h200_check_line():
    from trainer.scale.calibrate import h200_check

    line = h200_check()
    assert "measured 21.80 ms" in line and ("PASS" in line or "FAIL" in line)
    pred = float(re.search(r"predicted ([\d.]+) ms", line).group(1))
    assert 10 < pred < 50


def test_fit_recovers_latency_and_bandwidth():
    from trainer.scale.calibrate import fit

    w, lat, bw = 4, 20e-6, 1e9
    pts = [(n, steps("all_gather", w) * lat + 0.75 * n / bw) for n in (4096, 65536, 1 << 20)]
    got_lat, got_bw = fit("all_gather", pts, w)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


def test_order_violations():
    from trainer.scale.calibrate import order_violations

    rows = [("a", 1.0, 1.0, ""), ("b", 2.0, 1.1, ""), ("c", 0.5, 2.0, "")]
    assert order_violations(rows) == ["a / c", "b / c"]  # a/b differ by 10%: not judged


def test_calibrate_writes_a_loadable_file(tmp_path):
    from trainer.scale.calibrate import calibrate_main

    out = str(tmp_path / "here.toml")
    assert calibrate_main(out, world=2, budget_s=35) == 0
    c = cl.load_cluster(out)
    assert c.devices_per_node == 2 and c["device.peak_tflops_fp32"] > 0
    assert c.get("ops.all_reduce.latency_us") and c["overlap.fsdp"] is False
    assert all(f.kind in ("measurement", "assumption") for f in c.figures.values())


def test_cluster_loads_without_tomllib(monkeypatch):
    """Python 3.10 without tomli: the small parser reads the shipped files to the same figures."""
    want = cl.load_cluster("aurora").figures
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "tomli", None)
    assert cl.load_cluster("aurora").figures == want


def test_a_layout_the_trainer_refuses_to_trace_is_priced_from_the_formulas_with_its_reason(capsys):
    """One micro-batch per data rank under PP=2: the trainer refuses 1F1B, so the automatic source says
    why in one line and falls back to the formulas; an explicit --source trace is refused with the reason."""
    from trainer.scale.model_cli import UsageError, trace_or_none

    p = make_plan("small-moe", world=4, pp=2, ep=1, global_batch=32)
    assert p.micro_batches == 1
    assert trace_or_none(p, "small-moe", False) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "priced from the formulas, not traced" in err[0] and "1F1B needs" in err[0]
    with pytest.raises(UsageError, match="--source trace: 1F1B needs"):
        trace_or_none(p, "small-moe", False, strict=True)
