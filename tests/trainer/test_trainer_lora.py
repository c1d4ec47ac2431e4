"""LoRA fine-tuning in the trainer: ``--lora.rank/--lora.alpha/--lora.targets`` from a transformers
checkpoint directory (``--model.init_from``): only the adapters train (every base weight stays as
loaded), they are checkpointed and resumed, and the exported adapter loads in stock PEFT onto the
same checkpoint, reproducing the trainer's logits."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from trainer_util import data_cache, one_thread  # noqa: E402,F401 (fixtures)
from trainer_util import small_cfg  # noqa: E402
from trainer.config import validate  # noqa: E402
from trainer.config.errors import ConfigError  # noqa: E402
from trainer.checkpoint.slots import scan  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def _logits(model, ids):
    with torch.no_grad():
        return model.lm_head(model.model(input_ids=ids, use_cache=False).last_hidden_state)


def _lora_cfg(data_cache, out, hf_dir, steps, **over):
    return small_cfg(data_cache, out, steps=steps, model__init_from=hf_dir, lora__rank=4, lora__alpha=8.0,
                     checkpoint__interval=2, eval__enabled=False, **over)


def test_lora_fine_tuning_from_a_transformers_checkpoint(data_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    base = Trainer(small_cfg(data_cache, str(tmp_path / "base"), eval__enabled=False))
    hf_dir = str(tmp_path / "hf")
    base.model.save_pretrained(hf_dir)  # a transformers checkpoint directory (OlmoeForCausalLM)
    loaded = {n: p.detach().clone() for n, p in base.model.named_parameters()}

    t = Trainer(_lora_cfg(data_cache, str(tmp_path / "run"), hf_dir, steps=3))
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and len(trainable) == 8
    hist = t.fit()
    assert len(hist) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in hist)
    for name, p in t.model.named_parameters():
        if "lora_" in name:
            continue
        ref = loaded[name.replace(".base_layer", "")]
        assert torch.equal(p, ref), f"{name} moved"
    lora_b = {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_B" in n}
    assert all(b.abs().sum() > 0 for b in lora_b.values())  # PEFT starts B at zero: the adapters trained

    # stock PEFT loads the exported adapter onto the same checkpoint, with transformers' own experts
    ids = torch.tensor([[84, 104, 101, 32, 113, 117, 105, 99, 107], [32, 98, 114, 111, 119, 110, 32, 84, 104]])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="grouped_mm")
    stock = peft.PeftModel.from_pretrained(hf, str(tmp_path / "run" / "lora")).eval()
    with torch.no_grad():
        got = stock(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, _logits(t.model, ids), rtol=1e-5, atol=1e-5)

    # the adapters were checkpointed at the end of the run (step 3): a resumed run continues from them
    r = Trainer(_lora_cfg(data_cache, str(tmp_path / "run"), hf_dir, steps=3))
    assert r.resume() and r.step == 3
    trained = dict(t.model.named_parameters())
    for n, p in r.model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, trained[n]), n
    # ... and at step 2 (--checkpoint.interval 2), as a run of 2 steps leaves them
    at_2 = next(info for _, info, _ in scan(tmp_path / "run" / "checkpoints") if info is not None and info.step == 2)
    r.checkpoints.restore(r.model, r.optimizer, info=at_2)
    again = Trainer(_lora_cfg(data_cache, str(tmp_path / "run2"), hf_dir, steps=2))
    again.fit()
    for n, p in r.model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, dict(again.model.named_parameters())[n]), n


@pytest.mark.parametrize("over, message", [
    (dict(lora__targets="q_proj"), "--lora.targets"),
    (dict(parallel__pp=2), "data parallelism only"),
    (dict(model__moe_impl="hf"), "moe_impl fastmoe"),
    (dict(eval__export_hf="x"), "--lora.export"),
])
def test_bad_lora_configs(data_cache, tmp_path, over, message):
    cfg = small_cfg(data_cache, str(tmp_path), lora__rank=2, **over)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2 if "parallel__pp" in over else 1)
