"""Every run prints one start-up summary, and a family config.json that leaves out a field the
model needs is refused naming it (the config class's default would silently be another model)."""
from __future__ import annotations

import json

import pytest

from fastmoe_xpu.integrations.families import tiny_config
from trainer.cli import config_from_args
from trainer.config import ConfigError, validate
from trainer.trainer import Trainer

from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)


def test_startup_summary_printed_once(data_cache, tmp_path, capsys) -> None:
    cfg = small_cfg(data_cache, str(tmp_path), "tiny-deepseek-v3", steps=1)
    cfg.eval.enabled = False
    Trainer(validate(cfg, 1)).fit()
    out = capsys.readouterr().out
    assert out.count("run:\n") == 1
    lines = {line.strip().split(":")[0]: line.strip() for line in out.splitlines() if line.startswith("  ")}
    assert "deepseek_v3" in lines["family"] and "experts_implementation='fastmoe'" in lines["family"]
    assert lines["experts"] == "experts: 8 per MoE layer, top-2"
    assert lines["vocabulary"] == "vocabulary: model 258, data 258"
    assert lines["layout"].startswith("layout: world 1 = PP 1 x DP 1 x EP 1 x TP 1")
    assert "context 16" in lines["data"] and lines["steps"].startswith("steps: 1 of 8 x 16 tokens")
    assert lines["parameters"].startswith("parameters: ") and "active per token" in lines["parameters"]
    assert str(tmp_path / "checkpoints") in lines["checkpoints"]


@pytest.mark.parametrize("drop,named", [
    (["num_experts", "num_local_experts"], "num_experts / n_routed_experts / num_local_experts"),
    (["vocab_size"], "vocab_size"),
    (["num_experts", "num_local_experts", "vocab_size"], "vocab_size, num_experts / n_routed_experts / num_local_experts"),
    (["num_experts_per_tok"], "num_experts_per_tok"),
    (["num_hidden_layers"], "num_hidden_layers"),
])
def test_missing_field_is_an_error(tmp_path, drop, named) -> None:
    d = tiny_config("qwen3_moe", vocab_size=300, num_experts=6).to_dict()
    for k in drop:
        d.pop(k, None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    cfg, _ = config_from_args(["--preset", "tiny-moe", "--model.hf_config", str(path)])
    with pytest.raises(ConfigError, match=f"does not set {named}: the model needs"):
        validate(cfg, 1)
