"""What a first use of the command lines meets: --help names values, options are not abbreviated,
the context comes from the data set, the tools' error lines name the path and the reason, the
sample prompts suit the embedded corpus, and a saved model keeps ``experts_implementation``."""
from __future__ import annotations

import json
import os

import pytest
import torch

from trainer.cli import build_parser, config_from_args, main
from trainer.data.build import preprocess_files
from trainer.data.preprocess import main as preprocess_main


@pytest.fixture(scope="module")
def data_c24(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("c24")
    (d / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200, encoding="utf-8")
    preprocess_files([str(d / "corpus.txt")], str(d / "data"), 24, "byte", 1, 0, "text", None, False, valid=2)
    return str(d / "data")


def test_help_names_the_presets_values_not_none():
    text = build_parser().format_help()
    assert "(default: None)" not in text
    assert "--data.context INT, --context INT" in text
    assert "(tiny-moe: 64)" in text  # the default preset's context
    # the preset given is the one --help speaks of
    cfg_help = build_parser(config_from_args(["--preset", "mula-7b-a1b"])[0]).format_help()
    assert "(mula-7b-a1b: 100000)" in " ".join(cfg_help.split())


@pytest.mark.parametrize("argv, hint", [(["--step", "2"], "--steps"), (["--dat", "x"], "--data")])
def test_abbreviations_are_refused_with_a_hint(argv, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: unrecognized arguments: {argv[0]}") and hint in err
    assert len(err.splitlines()) == 1  # no usage block


def test_context_comes_from_the_data_set(data_c24, tmp_path, capsys):
    cfg, _ = config_from_args(["--data", data_c24])
    assert cfg.data.context == 24
    cfg, _ = config_from_args(["--data", data_c24, "--context", "24"])
    assert cfg.data.context == 24
    # an explicit other value is refused before training, naming the option and both values
    rc = main(["--data", data_c24, "--context", "32", "--out", str(tmp_path / "o"), "--steps", "1",
               "--global-batch", "2", "--micro-batch", "1", "--no-logging.progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: data set") and "has context 24, --data.context asks for 32" in err
    with pytest.raises(ValueError, match="run fastmoe-preprocess first"):
        config_from_args(["--data", str(tmp_path / "missing")])


def test_threads_option_sets_and_prints_the_figure(data_c24, tmp_path, capsys, monkeypatch):
    """--threads N fixes torch's intra-op threads; the start-up summary says the figure and why."""
    from fastmoe_xpu import threads

    assert "--threads N" in build_parser().format_help()
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_CURRENT", None)
    try:
        rc = main(["--data", data_c24, "--out", str(tmp_path / "o"), "--steps", "1", "--global-batch", "2",
                   "--micro-batch", "1", "--no-logging.progress", "--no-eval.enabled", "--no-logging.tensorboard",
                   "--threads", "1"])
        out = capsys.readouterr().out
        assert rc == 0 and torch.get_num_threads() == 1
        assert "  threads: 1 (--threads; " in out
        rc = main(["--data", data_c24, "--out", str(tmp_path / "p"), "--steps", "1", "--threads", "0"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err == "error: --threads must be >= 1, got 0"
    finally:
        torch.set_num_threads(before)


def test_preprocess_errors_name_the_path_and_the_reason(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("some text " * 50)
    assert preprocess_main(["--input", str(tmp_path / "c.txt"), "--context", "4", "--out", "/proc/x/y",
                            "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastmoe-preprocess: error: cannot create --out /proc/x/y: ") and "Errno" not in err


def test_prompts_suit_the_embedded_corpus():
    from trainer.data.default_corpus import default_corpus
    from trainer.outputs.generate import PROMPTS

    text = "".join(default_corpus()[0])
    for prompt in PROMPTS:
        assert text.count(prompt) >= 200, f"{prompt!r} is rare in the corpus the default run trains on"


def test_saved_model_keeps_experts_implementation(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import fastmoe_xpu  # noqa: F401 (registers "fastmoe" and keeps it in saved configs)
    from transformers import AutoModelForCausalLM, OlmoeConfig, OlmoeForCausalLM

    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip("transformers without the experts interface")
    cfg = OlmoeConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2, vocab_size=64, num_attention_heads=2, num_key_value_heads=2,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = OlmoeForCausalLM._from_config(cfg, experts_implementation="fastmoe").eval()
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    # kept under a key transformers alone ignores, so the checkpoint loads without this package too
    assert saved["fastmoe_experts_implementation"] == "fastmoe" and "experts_implementation" not in saved
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert back.config._experts_implementation == "fastmoe"
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)
    # an explicit choice at load time still wins; another choice is saved as transformers saves it
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="grouped_mm")
    assert other.config._experts_implementation == "grouped_mm"
    other.save_pretrained(tmp_path / "g")
    saved = json.loads((tmp_path / "g" / "config.json").read_text())
    assert "experts_implementation" not in saved and "fastmoe_experts_implementation" not in saved
    assert os.path.isfile(tmp_path / "g" / "config.json")


def _preprocess(corpus: str, out: str, *extra: str) -> int:
    return preprocess_main(["--input", corpus, "--context", "16", "--out", out, "--quiet", "--valid", "2", *extra])


def test_preprocess_refuses_to_replace_a_data_set_unless_overwrite(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("first corpus text. " * 60)
    (tmp_path / "b.txt").write_text("another corpus entirely! " * 60)
    out = str(tmp_path / "data")
    assert _preprocess(str(tmp_path / "a.txt"), out) == 0
    first = json.loads((tmp_path / "data" / "manifest.json").read_text())
    capsys.readouterr()
    assert _preprocess(str(tmp_path / "b.txt"), out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"fastmoe-preprocess: error: --out {out} already holds "
                                                         "a data set")
    assert first["fingerprint"][:12] in err and "--overwrite" in err
    # nothing was touched: the manifest and the validation split are the first run's
    assert json.loads((tmp_path / "data" / "manifest.json").read_text()) == first
    assert (tmp_path / "data" / "valid.npy").is_file()
    # shard files without a manifest (a data set half deleted by hand) are refused the same way
    os.remove(tmp_path / "data" / "manifest.json")
    assert _preprocess(str(tmp_path / "b.txt"), out) == 2
    assert "already holds data set files (shard-00000-of-00001.npy, valid.npy)" in capsys.readouterr().err
    assert _preprocess(str(tmp_path / "b.txt"), out, "--overwrite") == 0
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["fingerprint"] != first["fingerprint"]
    # an empty or new directory needs no flag
    (tmp_path / "empty").mkdir()
    assert _preprocess(str(tmp_path / "a.txt"), str(tmp_path / "empty")) == 0


def test_resume_on_a_changed_data_set_names_both_fingerprints(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("first corpus text. " * 60)
    data = str(tmp_path / "data")
    assert _preprocess(str(tmp_path / "a.txt"), data) == 0
    old = json.loads((tmp_path / "data" / "manifest.json").read_text())["fingerprint"]
    argv = ["--data", data, "--out", str(tmp_path / "run"), "--steps", "2", "--global-batch", "2", "--micro-batch", "1",
            "--checkpoint.interval", "1", "--no-logging.progress", "--no-logging.plot", "--no-logging.tensorboard",
            "--no-eval.enabled", "--peak-tflops", "1"]
    assert main(argv) == 0
    assert _preprocess(str(tmp_path / "a.txt"), data, "--overwrite", "--seed", "5") == 0  # same path, new shuffle
    new = json.loads((tmp_path / "data" / "manifest.json").read_text())["fingerprint"]
    capsys.readouterr()
    assert main([*argv, "--steps", "3"]) == 2  # the data set is named first, before the schedule's change
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: the checkpoint "), err
    assert f"(fingerprint {old[:12]})" in err and f"(fingerprint {new[:12]})" in err
    assert "it was preprocessed again since; give --data the checkpoint's data set to resume" in err
    assert "--checkpoint.init_from" in err


@pytest.mark.parametrize("name, text, says", [
    ("corpus.txt", "plain words of a corpus\n" * 20, "is not a data set's manifest.json but an input file"),
    ("one.jsonl", '{"text": "a single document"}\n', "is not a data set's manifest.json; if it is training text"),
])
def test_data_given_raw_text_says_to_preprocess(tmp_path, capsys, name, text, says):
    (tmp_path / name).write_text(text)
    rc = main(["--data", str(tmp_path / name), "--out", str(tmp_path / "o"), "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert says in err and f"fastmoe-preprocess --input {tmp_path / name} --context C --out DIR" in err
    assert "Expecting value" not in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, n", [(["--ep", "2"], 2), (["--dp", "2", "--ep", "2"], 4), (["--pp", "2"], 2)])
def test_a_layout_on_one_process_suggests_starting_more(tmp_path, capsys, argv, n):
    rc = main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"this is one process: start {n} with fastmoe-train --nproc-per-node {n}" in err
    assert f"torchrun --nproc-per-node {n} -m fastmoe_trainer" in err


def test_export_errors_are_one_line_and_name_every_damaged_slot(tmp_path, capsys):
    from trainer.outputs.export import main as export_main
    from trainer.trainer import Trainer
    from trainer_util import small_cfg

    Trainer(small_cfg(str(tmp_path / "cache"), str(tmp_path / "run"), steps=2, checkpoint__interval=1,
                      eval__enabled=False)).fit()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("slot-*")) == ["slot-A", "slot-B"]
    capsys.readouterr()
    # an --out that cannot be a directory
    assert export_main(["--checkpoint", str(root), "--out", "/dev/null/x", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: cannot create --out /dev/null/x: Not a directory", err
    # both slots damaged: the error names both, each with its reason
    (root / "slot-A" / "MANIFEST.json").unlink()
    data = sorted((root / "slot-B").glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert export_main(["--checkpoint", str(root), "--out", str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: no valid checkpoint under {root}: "), err
    assert f"{root / 'slot-A' / 'MANIFEST.json'} is missing" in err
    assert f"{data} fails its sha256 check" in err
    assert not (tmp_path / "hf").exists()
