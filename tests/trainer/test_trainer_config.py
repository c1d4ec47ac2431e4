"""Config, presets and the command line: overrides land in the right field, and every bad input
gives one clear line on stderr and a non-zero exit before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.cli import EXIT_CONFIG_ERROR, config_from_args, main
from trainer.config import ConfigError, TrainConfig, field_docs, section_classes, validate
from trainer.config.presets import PRESETS, get_preset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_field_has_a_docstring() -> None:
    import dataclasses

    for section, cls in section_classes().items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (section, missing)


def test_presets_follow_the_published_table() -> None:
    table = {  # layers, hidden, heads, head size, intermediate, experts (0: dense), top-k
        "mula-1b": (16, 2048, 16, 128, 8192, 0, 0),
        "mula-7b-a1b": (16, 2048, 16, 128, 1024, 64, 8),
        "mula-20b-a2b": (32, 2048, 16, 128, 1024, 96, 8),
        "mula-100b-a7b": (48, 3072, 24, 128, 1536, 144, 8),
        "mula-220b-a10b": (64, 3072, 24, 128, 1536, 240, 8),
    }
    for name, (L, H, heads, hd, I, E, K) in table.items():
        c = get_preset(name)
        m = c.model
        assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim, m.intermediate_size) == (L, H, heads, hd, I)
        assert m.arch == ("olmo" if E == 0 else "olmoe")
        if E:
            assert (m.num_experts, m.top_k) == (E, K)
        # the recipe
        assert c.data.context == 2048 and c.schedule.warmup_steps == 2500
        assert (c.optim.lr, c.schedule.min_lr, c.optim.weight_decay, c.optim.grad_clip) == (4e-4, 4e-5, 0.1, 1.0)
        assert (c.optim.beta1, c.optim.beta2, c.optim.eps) == (0.9, 0.99, 1e-8)
        assert (m.load_balancing_coef, m.z_loss_coef) == (0.01, 0.001)
        validate(c, c.parallel.ep * 128)  # a layout of 128 replicas is valid for every preset
    assert set(PRESETS) >= {"tiny-moe", "tiny-dense"}


def test_overrides_reach_their_fields() -> None:
    cfg, _ = config_from_args([
        "--preset", "tiny-moe", "--steps", "7", "--lr", "1e-3", "--global-batch", "32", "--micro-batch", "4",
        "--out", "/tmp/x", "--ep", "2", "--moe-impl", "hf", "--model.num_layers", "3", "--no-logging.progress",
        "--data.path", "none", "--seed", "5", "--optim.grad_reduce_dtype", "bf16",
    ])
    assert (cfg.schedule.steps, cfg.optim.lr, cfg.schedule.global_batch, cfg.schedule.micro_batch) == (7, 1e-3, 32, 4)
    assert (cfg.logging.out, cfg.parallel.ep, cfg.model.moe_impl, cfg.model.num_layers) == ("/tmp/x", 2, "hf", 3)
    assert cfg.logging.progress is False and cfg.data.path is None and cfg.seed == 5
    assert cfg.optim.grad_reduce_dtype == "bf16"
    # the JSON form round-trips
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_dp_is_inferred_from_the_world() -> None:
    cfg = get_preset("tiny-moe")
    cfg.parallel.ep = 2
    cfg.schedule.micro_batch = 4
    validate(cfg, 4)
    assert cfg.parallel.dp == 2


@pytest.mark.parametrize("argv,message", [
    # unknown preset, listing the known ones
    (["--preset", "mula-3b"], "unknown preset 'mula-3b'; known presets: mula-1b"),
    # E = 8 experts cannot split over EP = 3
    (["--ep", "3"], "num_experts=8 is not divisible by EP=3"),
    # 10 instances cannot split into DP x EP x micro batch = 1 x 1 x 4
    (["--global-batch", "10", "--micro-batch", "4"], "global batch 10 is not divisible by DP x EP x micro batch = 1 x 1 x 4"),
    # a DP size the world (one process) does not have
    (["--dp", "2"], "world size 1 != PP x DP x EP = 1 x 2 x 1"),
    # a value of the wrong type
    (["--lr", "fast"], "--optim.lr expects float, got 'fast'"),
    # a choice outside the allowed set
    (["--moe-impl", "megablocks"], "--model.moe_impl must be one of ['fastmoe', 'hf'], got 'megablocks'"),
    # heads x head size must give the width
    (["--model.num_heads", "3"], "hidden_size=64 must equal num_heads * head_dim = 3 * 16"),
    # EP needs FastSparseMoeBlock
    (["--ep", "2", "--dp", "1", "--moe-impl", "hf"], "expert parallelism (EP=2) needs --model.moe_impl fastmoe"),
    # a dense model has no experts to split
    (["--preset", "tiny-dense", "--ep", "2"], "has no experts; EP must be 1"),
    # quantized expert GEMMs need experts run by FastSparseMoeBlock
    (["--preset", "tiny-dense", "--model.expert_precision", "int8"], "--model.expert_precision int8 needs a MoE model"),
    (["--optim.stochastic_rounding"], "need --model.param_dtype bf16, got 'fp32'"),
    (["--model.expert_precision", "int4"], "--model.expert_precision must be one of ['none', 'int8', 'fp8', 'fp8-block']"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path) -> None:
    code = main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("argv, want", [
    ([], False), (["--data.document_mask"], True), (["--no-data.document_mask"], False),
    (["--data.document_mask", "true"], True), (["--data.document_mask", "false"], False),
    (["--data.document_mask", "Yes"], True), (["--data.document_mask", "0"], False),
    (["--data.document_mask", "on", "--no-data.document_mask"], False),
])
def test_a_yes_no_option_takes_a_word_as_a_config_file_would(argv, want) -> None:
    """``--x``, ``--no-x`` and ``--x true|false`` (yes/no, on/off, 1/0, any case): the last one given wins."""
    cfg, _ = config_from_args(argv)
    assert cfg.data.document_mask is want


@pytest.mark.parametrize("argv, message", [
    (["--data.document_mask", "maybe"], "--data.document_mask takes true or false (or nothing), got 'maybe'"),
    (["--no-data.document_mask", "false"], "--no-data.document_mask takes no value (got 'false'): write "
                                           "--no-data.document_mask, or --data.document_mask false"),
])
def test_a_yes_no_option_refuses_other_words_in_one_line(argv, message, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_missing_data_set_fails_before_training(capsys, tmp_path) -> None:
    code = main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--no-logging.progress"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR and err.startswith("error: ") and err.count("\n") == 1, err
    assert "nowhere" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_module_entry_point_exits_non_zero() -> None:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", main.__module__.rpartition(".")[0], "--preset", "nope"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=300)
    assert p.returncode == EXIT_CONFIG_ERROR
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "unknown preset 'nope'" in p.stderr


def test_print_config_and_list_presets(capsys) -> None:
    assert main(["--preset", "mula-7b-a1b", "--print-config", "--global-batch", "3072"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["preset"] == "mula-7b-a1b" and cfg["model"]["num_experts"] == 64
    assert main(["--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "mula-220b-a10b" in out and "tiny-moe" in out


def test_get_preset_error_type() -> None:
    with pytest.raises(ConfigError):
        get_preset("nope")


def test_corrupt_data_shard_fails_before_training(capsys, tmp_path) -> None:
    import glob

    from trainer.data import ensure_default_dataset

    manifest = ensure_default_dataset(str(tmp_path / "cache"), 16, 0, progress=False)
    shard = sorted(glob.glob(os.path.join(os.path.dirname(manifest), "*.npy")))[0]
    with open(shard, "r+b") as f:  # flip one byte of the token payload
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    code = main(["--data", manifest, "--context", "16", "--out", str(tmp_path / "out"), "--no-logging.progress"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR and err.count("\n") == 1 and "corrupt" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
