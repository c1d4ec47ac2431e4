"""Dry-run planner: parameter counts against the published table and real models, the activation
formula against autograd's saved bytes, layouts and their errors."""
from __future__ import annotations

import itertools

import pytest
import torch

from parallel_util import run_workers, tiny_model
from trainer.parallelism.ac import apply_activation_checkpointing, remove_activation_checkpointing, saved_bytes
from trainer.parallelism.plan import (
    ModelShape,
    main,
    make_plan,
    param_totals,
    preset_shape,
    split_layers,
    stage_activation_bytes,
    stage_params,
)


@pytest.mark.parametrize("preset,total,active", [
    ("mula-1b", "1.3", "1.3"),          # dense OLMo: total == active
    ("mula-7b-a1b", "6.9", "1.3"),      # 64 experts, no EP in the paper
    ("mula-20b-a2b", "20", "2.4"),      # 96 experts
    ("mula-100b-a7b", "100", "7.6"),    # 144 experts, H=3072
    ("mula-220b-a10b", "220", "10"),    # 240 experts
])
def test_published_model_table(preset, total, active):
    """Counts agree with the paper's table to the digits it prints (billions, rounded)."""
    t = param_totals(preset_shape(preset)[0])

    def agrees(count: int, printed: str) -> bool:
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        return abs(count / 1e9 - float(printed)) <= 0.5 * 10 ** -decimals

    assert agrees(t.total, total), f"{preset}: total {t.total / 1e9:.3f}B vs published {total}B"
    assert agrees(t.active, active), f"{preset}: active {t.active / 1e9:.3f}B vs published {active}B"


@pytest.mark.parametrize("arch", ["olmoe", "olmo"])  # RMSNorm weights + router + experts; weightless LayerNorm + MLP
def test_counts_equal_a_real_model(arch):
    model = tiny_model(arch, seed=0)
    c = model.config
    shape = ModelShape(arch, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.hidden_size // c.num_attention_heads,
                       c.intermediate_size, getattr(c, "num_experts", 0) if arch == "olmoe" else 0,
                       getattr(c, "num_experts_per_tok", 0) if arch == "olmoe" else 0, c.vocab_size)
    t = param_totals(shape)
    params = dict(model.named_parameters())
    assert t.total == sum(p.numel() for p in params.values())
    assert t.expert == sum(p.numel() for n, p in params.items() if ".experts." in n)
    # stages: embedding first, norm + head last, layers contiguous, everything exactly once
    stages = stage_params(shape, 3)
    assert sum(s.total for s in stages) == t.total
    assert stages[0].has_embedding and stages[-1].has_head and not stages[1].has_embedding
    emb = params["model.embed_tokens.weight"].numel()
    head = params["lm_head.weight"].numel() + sum(p.numel() for n, p in params.items() if n == "model.norm.weight")
    per_layer = sum(p.numel() for n, p in params.items() if n.startswith("model.layers.0."))
    assert stages[0].total == emb + len(stages[0].layers) * per_layer
    assert stages[-1].total == head + len(stages[-1].layers) * per_layer


@pytest.mark.parametrize("num_layers,pp,sizes", [
    (64, 8, [8] * 8),        # the 220B layout
    (48, 4, [12] * 4),       # the 100B layout
    (10, 4, [3, 3, 2, 2]),   # uneven: the first stages take one more
    (4, 4, [1, 1, 1, 1]),    # one layer per stage
])
def test_split_layers(num_layers, pp, sizes):
    ranges = split_layers(num_layers, pp)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(num_layers))


def test_split_layers_rejects_too_many_stages():
    with pytest.raises(ValueError, match="cannot fill"):
        split_layers(3, 4)


@pytest.mark.parametrize("arch,dtype", [
    ("olmoe", torch.float32),   # FastSparseMoeBlock, fp32
    ("olmoe", torch.bfloat16),  # bf16 weights: RMSNorm keeps fp32 copies, the rest bf16
    ("olmo", torch.float32),    # dense, weightless LayerNorm
    ("olmo", torch.bfloat16),   # dense bf16: OLMo's rotary cos/sin stay fp32
])
def test_activation_formula_equals_saved_bytes(arch, dtype):
    """The planner's per-micro-batch formula equals autograd's saved bytes exactly, for every
    subset of --ac choices."""
    model = tiny_model(arch, seed=0).to(dtype)
    c = model.config
    shape = ModelShape(arch, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                       c.hidden_size // c.num_attention_heads, c.intermediate_size,
                       c.num_experts if arch == "olmoe" else 0, c.num_experts_per_tok if arch == "olmoe" else 0,
                       c.vocab_size)
    B, S = 3, 10
    x = torch.randint(0, c.vocab_size, (B, S))
    for r in range(4):
        for combo in itertools.combinations(("norm", "attn", "moe"), r):
            remove_activation_checkpointing(model)
            apply_activation_checkpointing(model, combo)
            stats, _ = saved_bytes(model, lambda: model(input_ids=x, labels=x).loss)
            want = stage_activation_bytes(shape, B, S, c.num_hidden_layers, combo, act_bytes=dtype.itemsize)
            assert stats.bytes == want, f"--ac {combo}: measured {stats.bytes}, formula {want}"


def test_plan_220b_layout_and_memory():
    p = make_plan("mula-220b-a10b", world=12288, pp=8, ep=12)
    assert (p.pp, p.dp, p.ep) == (8, 128, 12)
    assert [len(s.layers) for s in p.stages] == [8] * 8
    st = p.stages[0]
    ne, ex = p.rank_params(st)
    assert ex == st.expert // 12
    # EPSO: non-expert states over DP x EP, expert states over DP -> both over 1536 here
    assert p.optimizer_bytes(st, "epso") == 12 * (-(-ne // 1536) + -(-ex // 128))
    assert p.optimizer_bytes(st, "epso") < p.optimizer_bytes(st, "sharded") < p.optimizer_bytes(st, "adamw")
    # checkpointing everything saves the most
    acts = [p.activation_bytes(st, c) for c in ((), ("norm",), ("attn",), ("moe",), ("norm", "attn", "moe"))]
    assert acts[-1] == min(acts) and acts[0] == max(acts)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world=100, pp=8, ep=12), "not divisible by PP x EP"),        # world does not factor
    (dict(world=18, pp=1, ep=9, ranks_per_node=18), "not divisible by EP=9"),  # 240 experts over EP=9
    (dict(world=96, pp=1, ep=24, ranks_per_node=12), "within a node"),  # EP spans nodes
    (dict(world=12288, pp=8, ep=12, global_batch=1000), "global batch 1000"),
])
def test_plan_rejects_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_plan("mula-220b-a10b", **kwargs)


def test_cli_prints_the_plan(capsys):
    assert main(["--preset", "mula-220b-a10b", "--world", "12288", "--pp", "8", "--ep", "12"]) == 0
    out = capsys.readouterr().out
    assert "world 12288 = PP 8 x DP 128 x EP 12" in out
    assert "total 220.21B  active 10.02B" in out
    assert "norm+attn+moe" in out and "1F1B" in out
    assert main(["--preset", "nope", "--world", "8"]) == 2


def _ep_formula_worker() -> list[tuple[tuple[str, ...], int, int]]:
    import torch.distributed as dist

    model = tiny_model("olmoe", seed=0, ep_group=dist.group.WORLD, forced_uniform_routing=True)
    c = model.config
    shape = ModelShape("olmoe", c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                       c.hidden_size // c.num_attention_heads, c.intermediate_size, c.num_experts,
                       c.num_experts_per_tok, c.vocab_size)
    B, S = 2, 8
    x = torch.randint(0, c.vocab_size, (B, S), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = []
    for r in range(4):
        for combo in itertools.combinations(("norm", "attn", "moe"), r):
            remove_activation_checkpointing(model)
            apply_activation_checkpointing(model, combo)
            stats, loss = saved_bytes(model, lambda: model(input_ids=x, labels=x).loss)
            loss.backward()  # the checkpointed EP block recomputes its collectives in step on both ranks
            want = stage_activation_bytes(shape, B, S, c.num_hidden_layers, combo, act_bytes=4, ep=2,
                                          forced_uniform=True)
            out.append((combo, stats.bytes, want))
    return out


def test_activation_formula_under_expert_parallelism():
    """EP=2 with forced uniform routing (so each rank computes exactly T*K rows): the gathered
    tokens, routing weights and prefix sums over EP*T tokens are where the formula says."""
    for rank_rows in run_workers(_ep_formula_worker, 2):
        for combo, measured, want in rank_rows:
            assert measured == want, f"--ac {combo}: measured {measured}, formula {want}"


def test_fsdp_row_shards_the_non_expert_weights() -> None:
    """--parallel.dp_shard fsdp in the dry run: non-expert weights, gradients and states / (DP x EP),
    experts as EPSO, plus the weights gathered at once (the root's embedding and head, kept from its
    forward to its backward, and two layers); below EPSO, which keeps whole non-expert weights.
    Traffic: each micro-batch gathers every layer twice and the root once, and reduce-scatters."""
    from trainer.parallelism.plan import OPT_STATE_BYTES, embedding_params, head_params, layer_params, make_plan

    p = make_plan("mula-20b-a2b", world=48, ep=12)
    st = p.stages[0]
    ne, ex = p.rank_params(st)
    w, g, o, tr = p.state_bytes(st, "fsdp")
    wb = p.weight_bytes
    assert w == g == wb * (-(-ne // 48) + ex)
    assert o == OPT_STATE_BYTES * (-(-ne // 48) + -(-ex // p.dp))
    layer = layer_params(p.shape).non_expert
    assert st.has_embedding and st.has_head
    assert tr == wb * (embedding_params(p.shape) + head_params(p.shape) + 2 * layer)
    assert p.traffic_bytes(st, "fsdp") == round(p.micro_batches * 47 / 48 * wb * (2 * ne + len(st.layers) * layer)
                                                + (p.dp - 1) / p.dp * 2 * wb * ex)
    assert p.traffic_bytes(st, "epso") == round(47 / 48 * 2 * wb * ne + (p.dp - 1) / p.dp * 2 * wb * ex)
    ew, eg, eo, etr = p.state_bytes(st, "epso")
    assert (ew, eg, eo, etr) == (wb * (ne + ex), wb * (ne + ex), p.optimizer_bytes(st, "epso"), 0)
    assert w + g + o + tr < ew + eg + eo


def test_sent_bytes_follow_the_ring_conventions() -> None:
    """The measurement's byte count per c10d op: all-reduce 2 (W-1)/W S, all-gather and reduce-scatter
    (W-1)/W of the whole buffer, all-to-all what leaves the rank, send its bytes, receive nothing."""
    from trainer.parallelism.measure import _sent_bytes

    t = torch.zeros(8)  # 32 bytes
    assert _sent_bytes("allreduce_", [[t]], 4, 0) == 48
    assert _sent_bytes("_allgather_base_", [torch.zeros(32), t], 4, 1) == 96
    assert _sent_bytes("_reduce_scatter_base_", [t, torch.zeros(32)], 4, 1) == 96
    assert _sent_bytes("alltoall_base_", [t, torch.zeros(4, 2), None, [1, 3], [1, 3]], 2, 1) == 8
    assert _sent_bytes("send", [[t]], 2, 0) == 32 and _sent_bytes("recv_", [[t]], 2, 1) == 0


def _measure_worker(data_cache: str, layout: str) -> dict:
    from trainer.parallelism.measure import measure_rank

    return measure_rank("tiny-moe", 2, 1, layout, MEASURE_SIZES, data_cache)


MEASURE_SIZES = {"context": 16, "micro_batch": 2, "global_batch": 8}


def test_measured_step_is_what_the_planner_says(tmp_path) -> None:
    """One step of tiny-moe at world 2 (DP 2), measured per rank (trainer/parallelism/measure.py):
    ZeRO-1 and FSDP2 weights, gradients and optimizer states equal the planner's to 1% (padding),
    saved activations and FSDP2's gathered weights to 10%, the weight and gradient bytes sent per step
    to 1%; the FSDP2 row's total within 10%, and FSDP2 holds fewer weight bytes."""
    from trainer.parallelism.measure import COLUMNS, planned

    rows = {}
    for layout in ("ZeRO-1", "FSDP2"):
        want = planned("tiny-moe", 2, 1, MEASURE_SIZES, layout)
        for r in run_workers(_measure_worker, 2, str(tmp_path / "data"), layout):
            for c in ("weights", "grads", "optim", "sent"):
                assert r[c] == pytest.approx(want[c], rel=0.01), (layout, c)
            assert r["act"] == pytest.approx(want["act"], rel=0.1), layout
            assert r["gathered"] == pytest.approx(want["gathered"], rel=0.1) if layout == "FSDP2" else r["gathered"] == 0
            assert sum(r[c] for c in COLUMNS) == pytest.approx(sum(want[c] for c in COLUMNS), rel=0.1)
            rows[layout] = r
    assert rows["FSDP2"]["weights"] < rows["ZeRO-1"]["weights"]
    assert rows["FSDP2"]["ops"].get("_allgather_base_", 0) > rows["ZeRO-1"]["ops"].get("_allgather_base_", 0)
