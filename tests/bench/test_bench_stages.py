"""``--mode stages`` times the launchers inside the experts op's own bodies: every launcher of a
forward and backward appears once (the unweighted row sum of the input gradient as ``combine_dx``),
and the timed run computes what the op computes."""
import torch

from bench.harness.cases import make_case
from bench.harness.presets import PRESETS
from bench.studies.stages import _pipeline, _TimedLaunchers, format_stages, run_stages
from fastmoe_xpu.autograd.ops import mlp_combine_forward, route_rows
from fastmoe_xpu.kernels import kernels
from fastmoe_xpu.kernels.contract import LAUNCHERS


def test_every_launcher_of_the_op_is_timed_once():
    case = make_case(PRESETS["tiny"])
    times = _pipeline(case, kernels("torch"))()
    launcher_keys = set(times) - {"router (stage 1, not in providers)"}
    assert launcher_keys == (set(LAUNCHERS) - {"down_bwd"}) | {"combine_dx"}
    assert all(t > 0 for t in times.values())


def test_timed_launchers_compute_what_the_op_computes():
    case = make_case(PRESETS["tiny"])
    NR = case.preset.local_experts
    args = (case.x_TH, case.w_gate_up_N2IH.detach(), case.w_down_NHI.detach(), case.weights_TK)
    plain = kernels("torch")
    timed = _TimedLaunchers(plain, case.device)
    want = mlp_combine_forward(plain, *args, *route_rows(plain, case.topk_idx_TK, 0, NR, True))[0]
    got = mlp_combine_forward(timed, *args, *route_rows(timed, case.topk_idx_TK, 0, NR, True))[0]
    assert torch.equal(got, want)


def test_stage_table_has_a_share_for_every_launcher():
    res = run_stages(make_case(PRESETS["tiny"]), ["torch"], rounds=1, progress=False)
    text = format_stages(res)
    for name in ("count_tokens", "down_weighted_bwd", "router_weights_bwd", "combine_dx"):
        (line,) = [ln for ln in text.splitlines() if ln.split() and ln.split()[0] == name]
        assert "%" in line, line


def test_a_quantized_provider_times_its_kernel_set(monkeypatch):
    """``fastmoe/<backend>:<precision>`` runs kernel set ``<backend>+<precision>`` stage by stage."""
    import bench.studies.stages as stages

    asked = []
    real = stages.kernels
    monkeypatch.setattr(stages, "kernels", lambda name: asked.append(name) or real(name))
    res = run_stages(make_case(PRESETS["tiny"]), ["torch:int8"], rounds=1, progress=False)
    assert asked == ["torch+int8"] and res["backends"]["torch:int8"]["status"] == "ok", res["backends"]
    assert "down_weighted_bwd" in format_stages(res)
