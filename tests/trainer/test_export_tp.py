"""Export of tensor-parallel runs: the ``/tp<r>`` parts of every split weight are put back together,
and the exported model in plain transformers gives the trainer's logits (fp32, 1e-5)."""
from __future__ import annotations

import json

import pytest
import torch

from parallel_util import run_workers
from trainer_util import data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg

PROMPT_IDS = [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]  # "The quick brown"


def _cfg(data_cache: str, out: str, **over):
    return small_cfg(data_cache, out, "tiny-dense", steps=3, optim__lr=1e-3, eval__enabled=False,
                     eval__samples=False, **over)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.lm_head(model.model(input_ids=ids, use_cache=False).last_hidden_state)


def _tp_export_worker(data_cache: str, out: str, hf_dir: str, over: dict) -> dict:
    from trainer.parallelism.tp import gather_tensor_parallel
    from trainer.trainer import Trainer

    t = Trainer(_cfg(data_cache, out, eval__export_hf=hf_dir, **over))
    t.fit()
    modules = t.pipeline.modules if t.layout.pp > 1 else [t.model]
    full: dict[str, torch.Tensor] = {}
    for m in modules:  # a collective over this rank's TP group; stage modules keep the global names
        full.update(gather_tensor_parallel(m, t.layout.tp_group))
    q = next(mod for n, mod in modules[0].named_modules() if n.endswith("self_attn.q_proj"))
    out_ = {"full": full, "q_rows": q.weight.shape[0]}
    if t.layout.pp == 1:  # every TP rank takes part: the split layers all-reduce inside
        out_["logits"] = _logits(t.model, torch.tensor([PROMPT_IDS, PROMPT_IDS[::-1]]))
    return out_


@pytest.mark.distributed
@pytest.mark.parametrize("over,world", [({"parallel__tp": 2}, 2), ({"parallel__pp": 2, "parallel__tp": 2}, 4)])
def test_export_of_a_tp_run_matches_the_trainer(data_cache, tmp_path, over, world):
    from transformers import AutoModelForCausalLM

    from trainer.trainer import Trainer

    hf_dir = tmp_path / "hf"
    res = run_workers(_tp_export_worker, world, data_cache, str(tmp_path / "run"), str(hf_dir), over)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert type(hf).__name__ == "OlmoForCausalLM"
    # the run really was split: each rank held half of the query rows
    assert all(r["q_rows"] * 2 == hf.model.layers[0].self_attn.q_proj.weight.shape[0] for r in res)
    meta = json.loads((hf_dir / "fastmoe_export.json").read_text())
    assert meta["layout"].get("tp") == 2, meta["layout"]
    # every exported weight equals the trained TP weights gathered by the trainer's own collective
    full: dict[str, torch.Tensor] = {}
    for r in res:
        full.update(r["full"])
    sd = hf.state_dict()
    assert set(sd) <= set(full), sorted(set(sd) - set(full))
    for name in sd:
        torch.testing.assert_close(sd[name], full[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([PROMPT_IDS, PROMPT_IDS[::-1]])
    with torch.no_grad():
        logits = hf(ids).logits
    if "logits" in res[0]:  # the TP trainer's own forward
        for r in res:
            torch.testing.assert_close(logits, r["logits"], rtol=1e-5, atol=1e-5)
    # and the one-process trainer model holding the gathered weights
    one = Trainer(_cfg(data_cache, str(tmp_path / "one")))
    one.model.load_state_dict(full, strict=True)
    torch.testing.assert_close(logits, _logits(one.model, ids), rtol=1e-5, atol=1e-5)
