"""``--eval.export_hf`` and ``python -m trainer.outputs.export`` for transformers MoE families: the family's
own transformers directory, which a process that never imports this package loads and generates
with, giving the trainer's logits (fp32, 1e-5) and its greedy continuation."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from trainer.config import validate
from trainer.outputs.export import main as export_main
from trainer.trainer import Trainer
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]

#: Run with plain transformers in a fresh interpreter: logits and a greedy continuation of every directory.
_PLAIN = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
jobs = json.loads(sys.argv[1])
out = {}
for d in jobs["dirs"]:
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor(jobs["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        gen = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
    out[d] = {"logits": logits, "generated": gen[0].tolist(), "class": type(model).__name__,
              "impl": model.config._experts_implementation}
assert not any(m.startswith("fastmoe_xpu") or m.startswith("trainer") for m in sys.modules), "package imported"
torch.save(out, jobs["result"])
"""


def test_family_export_reloads_without_the_package(data_cache, tmp_path) -> None:
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]])
    want, dirs = {}, []
    for fam in FAMILIES:
        out = tmp_path / fam
        cfg = small_cfg(data_cache, str(out), "tiny-qwen3-moe", steps=2, model__hf_family=fam)
        cfg.eval.enabled = cfg.eval.samples = False
        cfg.eval.export_hf = str(out / "hf")
        t = Trainer(validate(cfg, 1))
        t.fit()
        t.model.eval()
        with torch.no_grad():
            logits = t.model(input_ids=ids, use_cache=False).logits
            ctx = ids[:1, :4]
            for _ in range(4):  # greedy, as generate() does
                nxt = t.model(input_ids=ctx, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                ctx = torch.cat([ctx, nxt], dim=1)
        want[str(out / "hf")] = (logits, ctx[0].tolist(), t.model.config.model_type)
        dirs.append(str(out / "hf"))
        cfg_json = json.loads((out / "hf" / "config.json").read_text())
        assert cfg_json["model_type"] == t.model.config.model_type and "fastmoe" not in json.dumps(cfg_json)
    # python -m trainer.outputs.export on the deepseek_v3 run's checkpoint writes the same directory
    ds = tmp_path / "deepseek_v3"
    assert export_main(["--checkpoint", str(ds / "checkpoints"), "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    dirs.append(str(tmp_path / "cli"))
    want[str(tmp_path / "cli")] = want[str(ds / "hf")]
    result = tmp_path / "plain.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _PLAIN, json.dumps({"dirs": dirs, "ids": ids.tolist(), "result": str(result)})],
                   check=True, timeout=240, env=env, cwd=str(tmp_path))
    got = torch.load(result)
    for d in dirs:
        logits, generated, family = want[d]
        assert got[d]["impl"] != "fastmoe" and family.replace("_", "") in got[d]["class"].lower().replace("_", "")
        torch.testing.assert_close(got[d]["logits"], logits, rtol=1e-5, atol=1e-5, msg=d)
        assert got[d]["generated"] == generated, d
