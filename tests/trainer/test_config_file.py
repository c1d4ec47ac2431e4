"""A run's configuration from a file (``--config run.toml`` / ``.yaml`` / ``.json``): the same nested
fields as the options, the options given on the command line override it, ``--print-config FORMAT``
writes one that reads back, and every mistake in it is one line naming the file and the field."""
from __future__ import annotations

import json

import pytest

from trainer.cli import EXIT_CONFIG_ERROR, config_from_args, main

RUN_TOML = """\
preset = "small-moe"
seed = 7

[optim]
lr = 1e-3
weight_decay = 0

[schedule]
steps = 40
global_batch = 16

[checkpoint]
dir = "ckpts"

[logging]
tensorboard = false
"""


def _printed(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_file_fields_land_and_options_override_them(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    cfg, _ = config_from_args(["--config", str(path)])
    assert cfg.preset == "small-moe" and cfg.seed == 7 and cfg.model.num_experts == 16  # the file's preset
    assert cfg.optim.lr == 1e-3 and cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)
    assert cfg.schedule.steps == 40 and cfg.schedule.global_batch == 16
    assert cfg.checkpoint.dir == "ckpts" and cfg.logging.tensorboard is False
    # options given beside the file win, field by field; the rest stays the file's
    cfg, _ = config_from_args(["--config", str(path), "--lr", "5e-4", "--logging.tensorboard",
                               "--checkpoint.dir", "none", "--preset", "tiny-moe"])
    assert cfg.preset == "tiny-moe" and cfg.model.num_experts == 8  # --preset over the file's preset
    assert cfg.optim.lr == 5e-4 and cfg.logging.tensorboard is True and cfg.checkpoint.dir is None
    assert cfg.schedule.steps == 40 and cfg.seed == 7


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
def test_print_config_reads_back(tmp_path, capsys, preset, fmt):
    if fmt == "yaml":
        pytest.importorskip("yaml")
    argv = ["--preset", preset, "--lr", "3e-4", "--steps", "17", "--checkpoint.dir", "ck", "--no-logging.plot",
            "--parallel.ac", "moe", "--seed", "3"]
    text = _printed(capsys, [*argv, "--print-config", fmt])
    path = tmp_path / f"run.{fmt}"
    path.write_text(text)
    assert _printed(capsys, ["--config", str(path), "--print-config", fmt]) == text
    want, _ = config_from_args(argv)
    got, _ = config_from_args(["--config", str(path)])
    assert got.to_dict() == want.to_dict()


def test_print_config_of_a_layout_for_another_world(capsys):
    # a preset laid out for 12 ranks prints from one process with --world 12
    text = _printed(capsys, ["--preset", "mula-20b-a2b", "--world", "12", "--print-config", "toml"])
    assert 'preset = "mula-20b-a2b"' in text and "ep = 12" in text and "dp = 0" in text  # dp as given
    assert json.loads(_printed(capsys, ["--print-config"]))["preset"] == "tiny-moe"  # json, the default


def test_yaml_and_json_files_and_run_json(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 3e-4\nschedule:\n  steps: 9\ndata.path: null\n")
    cfg, _ = config_from_args(["--config", str(tmp_path / "run.yaml")])
    assert cfg.optim.lr == 3e-4 and cfg.schedule.steps == 9  # YAML reads 3e-4 as a string: parsed as the option
    (tmp_path / "run.json").write_text(json.dumps({"model": {"top_k": 3}, "parallel.ac": "moe"}))
    cfg, _ = config_from_args(["--config", str(tmp_path / "run.json")])
    assert cfg.model.top_k == 3 and cfg.parallel.ac == "moe"
    # a run directory's run.json: its "config" object
    base, _ = config_from_args(["--preset", "small-moe", "--steps", "11"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text(json.dumps({"config": base.to_dict(), "layout": {"world": 1}}))
    cfg, _ = config_from_args(["--config", str(tmp_path / "out" / "run.json")])
    assert cfg.to_dict() == base.to_dict()


def test_context_comes_from_the_data_set_unless_the_file_names_it(tmp_path):
    from trainer.data.preprocess import main as preprocess_main

    (tmp_path / "c.txt").write_text("some text for a data set. " * 80)
    assert preprocess_main(["--input", str(tmp_path / "c.txt"), "--context", "24", "--out", str(tmp_path / "d"),
                            "--quiet"]) == 0
    (tmp_path / "a.toml").write_text(f'[data]\npath = "{tmp_path / "d"}"\n')
    assert config_from_args(["--config", str(tmp_path / "a.toml")])[0].data.context == 24
    (tmp_path / "b.toml").write_text(f'[data]\npath = "{tmp_path / "d"}"\ncontext = 32\n')
    assert config_from_args(["--config", str(tmp_path / "b.toml")])[0].data.context == 32  # refused later, named


@pytest.mark.parametrize("name, text, says", [
    ("a.toml", "[optim]\nlrr = 1e-3\n", "unknown field 'lrr' in [optim] (did you mean lr?)"),
    ("b.toml", "[optimizer]\nlr = 1e-3\n", "unknown key 'optimizer' (did you mean optim?)"),
    ("c.toml", "[optim]\nlr = \"fast\"\n", "optim.lr expects float, got 'fast'"),
    ("d.toml", "[model]\ncompile = \"yes\"\n", "model.compile must be true or false, got 'yes'"),
    ("e.toml", "[schedule]\nsteps = 2.5\n", "schedule.steps expects int, got 2.5"),
    ("f.toml", "[optim\nlr = 1\n", "is not valid TOML"),
    ("g.toml", "optim = 3\n", "optim must be a table of fields, got 3"),
    ("h.ini", "[optim]\n", "unknown format '.ini'; use .toml, .yaml, .yml or .json"),
    ("i.json", "[1, 2]", "expected a table of fields at the top, got list"),
    ("j.toml", "preset = \"nope\"\n", "unknown preset 'nope'"),
    ("k.toml", "[model]\nnum_experts = 6\n", "num_experts=6 is not divisible by EP=4"),  # validated as options are
])
def test_mistakes_in_the_file_are_one_line(tmp_path, capsys, name, text, says):
    (tmp_path / name).write_text(text)
    extra = ["--ep", "4", "--dp", "1"] if name == "k.toml" else []
    rc = main(["--config", str(tmp_path / name), "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc == EXIT_CONFIG_ERROR and err.count("\n") == 1 and err.startswith("error: "), err
    assert says in err, err
    if name not in ("j.toml", "k.toml"):
        assert f"--config {tmp_path / name}" in err
    assert not (tmp_path / "o").exists()


def test_a_missing_file_is_one_line(tmp_path, capsys):
    rc = main(["--config", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_CONFIG_ERROR and err == f"error: --config {tmp_path / 'nope.toml'}: No such file or directory"
