"""Document masking (``--data.document_mask``): every data set records its EOS id and the trainer finds it;
a packed instance's logits equal each document run alone (the trainer's OLMoE, Qwen3-MoE, Mixtral; eager,
sdpa, compiled); the trainer's losses are those of the documents alone, on one process and on every layout
(FSDP2, PP, TP, EP on two gloo processes); a data set without an EOS id is refused in one line."""
from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.config import ConfigError, ModelConfig
from trainer.data import ShardedDataset, ensure_default_dataset, load_manifest, manifest_eos_id, preprocess_files
from trainer.data.build import build_dataset, memory_source
from trainer.data.mixture import MixtureDataset
from trainer.model.build import build_model
from trainer.model.documents import document_kwargs, document_position_ids
from fastmoe_xpu.compiling import compile_decoder
from parallel_util import run_workers
from trainer.trainer import Trainer
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

EOS = 256  # the byte tokenizer's


def _docs(n: int) -> list[str]:
    return [f"document {i} " + "abcdefgh"[: 1 + i % 8] * (1 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def text_set(tmp_path_factory) -> str:
    """A data set of a JSONL file (one document per line), context 16, made as fastmoe-preprocess makes it."""
    d = tmp_path_factory.mktemp("docs")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(60)), encoding="utf-8")
    return preprocess_files([str(src)], str(d / "set"), 16, progress=False)


def test_every_built_data_set_records_the_eos_id(text_set, tmp_path) -> None:
    """Files (fastmoe-preprocess), memory sources and the embedded corpus all record the tokenizer's EOS
    id in the manifest, and the data set and a mixture of sets read it back."""
    mem = build_dataset([memory_source("<mem>", _docs(40))], str(tmp_path / "mem"), 16, progress=False)
    default = ensure_default_dataset(str(tmp_path / "cache"), 16, progress=False, valid=0)
    for path in (text_set, mem, default):
        m = load_manifest(path)
        assert m["tokenizer"]["eos_id"] == EOS
        assert manifest_eos_id(m) == EOS
        assert ShardedDataset(path).eos_id == EOS
    mix = MixtureDataset(f"a={os.path.dirname(text_set)}:1,b={os.path.dirname(mem)}:1")
    assert mix.eos_id == EOS and manifest_eos_id(mix.manifest) == EOS


def test_a_manifest_without_an_eos_id_reads_as_none() -> None:
    assert manifest_eos_id({"tokenizer": {"type": "byte", "vocab_size": 258}}) is None
    assert manifest_eos_id({}) is None
    assert manifest_eos_id({"tokenizer": {"eos_id": 7}}) == 7


# ------------------------------------------------------------------------------------------ the model path
def test_positions_restart_after_every_eos() -> None:
    ids = torch.tensor([[9, 9, EOS, 9, 9, 9, EOS, EOS, 9], [9, 9, 9, 9, 9, 9, 9, 9, 9], [EOS, 9, 9, 9, 9, 9, 9, 9, EOS]])
    assert document_position_ids(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], list(range(9)),
                                                          [0, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert document_kwargs(ids, None) == {}
    assert torch.equal(document_kwargs(ids, EOS)["position_ids"], document_position_ids(ids, EOS))


#: the tiny models' end-of-document id
DOC_EOS = 3
TINY = dict(vocab_size=40, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=None,
            pad_token_id=None, bos_token_id=None)


def _family(name: str, attn: str) -> torch.nn.Module:
    """A tiny model of ``name`` (built here, nothing downloaded) with attention implementation ``attn``; "olmoe"
    is the trainer's own build (OLMoE with FastSparseMoeBlock patched in)."""
    torch.manual_seed(0)
    if name == "olmoe":
        m = ModelConfig(vocab_size=TINY["vocab_size"], num_layers=2, hidden_size=32, num_heads=4, head_dim=8,
                        intermediate_size=16, num_experts=4, top_k=2)
        model = build_model(m, 64, seed=0)
        model.set_attn_implementation(attn)
        return model.eval()
    import transformers

    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          head_dim=8, attn_implementation=attn)
        return transformers.Qwen3MoeForCausalLM(cfg).eval()
    cfg = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, attn_implementation=attn)
    return transformers.MixtralForCausalLM(cfg).eval()


def _packed_batch() -> torch.Tensor:
    """Two instances of 24 tokens: four documents (one ending at the last token, one of a single DOC_EOS) and two."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(DOC_EOS + 1, TINY["vocab_size"], (2, 24), generator=g)
    ids[0, [5, 6, 15, 23]] = DOC_EOS
    ids[1, 9] = DOC_EOS
    return ids


def _assert_documents_alone(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Logits of the packed instances with document positions equal each document run alone (fp32, atol 1e-5),
    and differ from attention across the documents (so the check is not vacuous)."""
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **document_kwargs(ids, DOC_EOS)).logits
        across = model(input_ids=ids, use_cache=False).logits
        for b in range(ids.shape[0]):
            starts = [0] + [i + 1 for i in range(ids.shape[1] - 1) if ids[b, i] == DOC_EOS]
            for s, e in zip(starts, starts[1:] + [ids.shape[1]]):
                alone = model(input_ids=ids[b:b + 1, s:e], use_cache=False).logits[0]
                torch.testing.assert_close(packed[b, s:e], alone, rtol=0, atol=1e-5,
                                           msg=lambda m, b=b, s=s: f"instance {b}, document at {s}: {m}")
    assert (packed - across).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
def test_packed_logits_equal_each_document_alone(family: str, attn: str) -> None:
    _assert_documents_alone(_family(family, attn), _packed_batch())


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_compiled_packed_logits_equal_each_document_alone(family: str) -> None:
    """The trainer's --model.compile (the decoder stack compiled whole, fullgraph; aot_eager traces the graphs
    inductor would get) keeps the documents apart: traced, transformers builds the packed mask unconditionally."""
    torch._dynamo.reset()
    model = _family(family, "sdpa")
    compile_decoder(model, fullgraph=True, backend="aot_eager")
    _assert_documents_alone(model, _packed_batch())


# ------------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def short_docs_set(tmp_path_factory) -> str:
    """Documents of 3-12 bytes, so that every 16-token instance packs several; 8 instances held out."""
    d = tmp_path_factory.mktemp("short")
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefgh xyz"), size=int(rng.integers(3, 13)))) for _ in range(300)]
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return preprocess_files([str(src)], str(d / "set"), 16, progress=False, valid=8)


def _documents_alone_ce(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(summed cross-entropy, targets) of ``ids`` [N, C] when each document of each instance is run alone
    through ``model`` (the document's last target, after its EOS, included)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for b in range(ids.shape[0]):
            starts = [0] + [i + 1 for i in range(ids.shape[1] - 1) if ids[b, i] == EOS]
            for s, e in zip(starts, starts[1:] + [ids.shape[1]]):
                logits = model(input_ids=ids[b:b + 1, s:e], use_cache=False).logits[0]
                total += float(F.cross_entropy(logits.double(), labels[b, s:e], reduction="sum"))
                n += e - s
    return total, n


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_trainer_losses_are_those_of_each_document_alone(short_docs_set, data_cache, tmp_path, capsys,
                                                         preset) -> None:
    """With --data.document_mask the first step's LM loss and the validation loss equal the cross-entropy of
    every document run alone through the same weights (rtol 1e-5), and differ from the run without it; the
    start-up summary and run.json say which. The trainer's OLMoE path and a transformers family's (--model.arch hf)."""
    cfg = small_cfg(data_cache, str(tmp_path / "on"), preset=preset, steps=1, data__path=short_docs_set,
                    data__document_mask=True)
    trainer = Trainer(cfg)
    assert trainer.document_eos == EOS
    model = copy.deepcopy(trainer.model)  # the weights of the first step
    micro = trainer.loader.batch_at(0)
    ce, n = _documents_alone_ce(model, torch.cat([mb[0] for mb in micro]), torch.cat([mb[1] for mb in micro]))
    val = np.load(os.path.join(os.path.dirname(short_docs_set), "valid.npy")).astype(np.int64)
    val_ce, val_n = _documents_alone_ce(model, torch.from_numpy(val[:, :-1]), torch.from_numpy(val[:, 1:]))
    assert trainer.evaluate()["val_loss"] == pytest.approx(val_ce / val_n, rel=1e-5)
    on = trainer.fit()
    assert on[0]["lm_loss"] == pytest.approx(ce / n, rel=1e-5)
    assert "document mask on (attention within each document, split at EOS id 256)" in capsys.readouterr().out
    assert json.loads((tmp_path / "on" / "run.json").read_text())["config"]["data"]["document_mask"] is True

    off = Trainer(small_cfg(data_cache, str(tmp_path / "off"), preset=preset, steps=1,
                            data__path=short_docs_set)).fit()
    assert off[0]["lm_loss"] != pytest.approx(ce / n, rel=1e-5)  # attention across documents: another loss
    assert "document mask off" in capsys.readouterr().out


def test_a_data_set_without_an_eos_id_is_refused_in_one_line(short_docs_set, data_cache, tmp_path) -> None:
    old = tmp_path / "old"
    shutil.copytree(os.path.dirname(short_docs_set), old)
    m = json.loads((old / "manifest.json").read_text())
    del m["tokenizer"]["eos_id"]
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=r"--data.document_mask needs the end-of-document id.*records none.*"
                                          r"fastmoe-preprocess.*or leave --data.document_mask out") as e:
        Trainer(small_cfg(data_cache, str(tmp_path / "run"), steps=1, data__path=str(old), data__document_mask=True))
    assert "\n" not in str(e.value)
    Trainer(small_cfg(data_cache, str(tmp_path / "run2"), steps=1, data__path=str(old)))  # off: trains as before


def test_mask_bench_prints_both_runs(short_docs_set, capsys) -> None:
    """``python -m trainer.data.mask_bench``: both trainers step in turn and the table names both."""
    from trainer.data.mask_bench import main

    assert main(["--preset", "tiny-moe", "--steps", "3", "--data", short_docs_set, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "instances holding a document boundary: 48/48 (100%)" in out
    assert "| off |" in out and "| on |" in out and "on / off:" in out


# ------------------------------------------------------------------------------------------ layouts
def _layout_worker(data_cache: str, out: str, data: str, preset: str, mask: bool, fsdp: bool, pp: int = 1,
                   tp: int = 1, ep: int = 1) -> dict:
    cfg = small_cfg(data_cache, out, preset, steps=2, data__path=data, data__document_mask=mask,
                    parallel__dp_shard="fsdp" if fsdp else "none", parallel__pp=pp, parallel__tp=tp, parallel__ep=ep,
                    eval__instances=8, eval__micro_batch=4)
    cfg.eval.moe_health = False
    t = Trainer(cfg)
    hist = t.fit()
    return {"losses": [r["lm_loss"] for r in hist], "val": hist[-1]["val_loss"], "fsdp": t.fsdp,
            "stages": t.pipeline is not None}


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_fsdp2_carries_the_document_positions(short_docs_set, data_cache, tmp_path, preset) -> None:
    """FSDP2 on two gloo processes (the root's whole-model forward: the trainer's OLMoE path and a
    transformers family's) trains and evaluates with the document mask as one process does (rtol 1e-5),
    and not as one process does without it."""
    one = _layout_worker(data_cache, str(tmp_path / "one"), short_docs_set, preset, True, False)
    fsdp = run_workers(_layout_worker, 2, data_cache, str(tmp_path / "fsdp"), short_docs_set, preset, True, True)
    off = _layout_worker(data_cache, str(tmp_path / "off"), short_docs_set, preset, False, False)
    for r in fsdp:
        assert r["fsdp"]
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert r["val"] == pytest.approx(one["val"], rel=1e-5)
    assert off["losses"][0] != pytest.approx(one["losses"][0], rel=1e-5)
    assert off["val"] != pytest.approx(one["val"], rel=1e-5)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3-moe"])
def test_pipeline_stages_carry_the_document_positions(short_docs_set, data_cache, tmp_path, preset) -> None:
    """PP=2 on two gloo processes (1F1B; every stage's rank computes the positions of the micro-batch it runs)
    trains and evaluates with the document mask as one process does (rtol 1e-5), and not as it does without it."""
    one = _layout_worker(data_cache, str(tmp_path / "one"), short_docs_set, preset, True, False)
    pp = run_workers(_layout_worker, 2, data_cache, str(tmp_path / "pp"), short_docs_set, preset, True, False, 2)
    off = run_workers(_layout_worker, 2, data_cache, str(tmp_path / "off"), short_docs_set, preset, False, False, 2)
    for r in pp:
        assert r["stages"]
    last = pp[-1]  # the last stage holds the loss
    assert last["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert last["val"] == pytest.approx(one["val"], rel=1e-5)
    assert off[-1]["losses"][0] != pytest.approx(one["losses"][0], rel=1e-5)
    assert off[-1]["val"] != pytest.approx(one["val"], rel=1e-5)


@pytest.mark.parametrize("preset,axes", [("tiny-dense", {"tp": 2}), ("tiny-moe", {"ep": 2})])
def test_tensor_and_expert_parallel_carry_the_document_mask(short_docs_set, data_cache, tmp_path, preset,
                                                            axes) -> None:
    """TP=2 (the dense OLMo's heads split) and EP=2 (OLMoE's experts split, tokens exchanged) on two gloo
    processes train and evaluate with the document mask as one process does (rtol 1e-5)."""
    one = _layout_worker(data_cache, str(tmp_path / "one"), short_docs_set, preset, True, False)
    off = _layout_worker(data_cache, str(tmp_path / "off"), short_docs_set, preset, False, False)
    tp, ep = axes.get("tp", 1), axes.get("ep", 1)
    res = run_workers(_layout_worker, 2, data_cache, str(tmp_path / "par"), short_docs_set, preset, True, False, 1,
                      tp, ep)
    for r in res:  # every rank, TP's second included, has the losses and the validation loss
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert r["val"] == pytest.approx(one["val"], rel=1e-5)
    assert off["losses"][0] != pytest.approx(one["losses"][0], rel=1e-5)


def test_compiled_trainer_keeps_the_document_mask(short_docs_set, data_cache, tmp_path) -> None:
    """--model.compile (aot_eager) with --data.document_mask trains to the eager run's losses (rtol 1e-5)."""
    torch._dynamo.reset()
    eager = _layout_worker(data_cache, str(tmp_path / "eager"), short_docs_set, "tiny-moe", True, False)
    cfg = small_cfg(data_cache, str(tmp_path / "compiled"), steps=2, data__path=short_docs_set,
                    data__document_mask=True, model__compile=True, model__compile_backend="aot_eager",
                    eval__instances=8, eval__micro_batch=4)
    cfg.eval.moe_health = False
    hist = Trainer(cfg).fit()
    assert [r["lm_loss"] for r in hist] == pytest.approx(eager["losses"], rel=1e-5)
    assert hist[-1]["val_loss"] == pytest.approx(eager["val"], rel=1e-5)


def test_a_run_is_not_resumed_with_the_mask_changed(short_docs_set, data_cache, tmp_path) -> None:  # noqa: F811
    """The mask is part of what a run is: the same --out with it turned on (or off) is refused in one
    line naming the change; a run.json of an earlier version, without the field, reads as mask off."""
    out = tmp_path / "run"
    Trainer(small_cfg(data_cache, str(out), steps=1, data__path=short_docs_set)).fit()
    with pytest.raises(ConfigError, match=r"holds another run .*--data\.document_mask False -> True"):
        Trainer(small_cfg(data_cache, str(out), steps=2, data__path=short_docs_set, data__document_mask=True))
    run_json = out / "run.json"
    rec = json.loads(run_json.read_text())
    del rec["config"]["data"]["document_mask"]
    run_json.write_text(json.dumps(rec))
    Trainer(small_cfg(data_cache, str(out), steps=2, data__path=short_docs_set,
                      checkpoint__reschedule=True)).fit()  # resumes: off, as before
    with pytest.raises(ConfigError, match=r"--data\.document_mask False -> True"):
        Trainer(small_cfg(data_cache, str(out), steps=3, data__path=short_docs_set, data__document_mask=True))
