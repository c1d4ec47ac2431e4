"""Data mixtures (``--data NAME=PATH:WEIGHT,...``, trainer/data/mixture.py): which source each
instance comes from, each source's own order, exact resume on other DP layouts, per-source
validation loss in the records, the header, and the refusals of bad mixtures (exit 2, one line)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer.config import ConfigError
from trainer.data import ShardedDataset, ShardedLoader, preprocess_files
from trainer.data.mixture import MixtureDataset, parse_mixture, slot_counts
from trainer.records.metrics import read_metrics
from trainer.records.startup import startup_summary
from trainer.trainer import Trainer
from trainer_util import data_cache, small_cfg  # noqa: F401 (fixture)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_set(tmp_path, name: str, letters: str, context: int = 16, valid: float = 0) -> str:
    rng = np.random.default_rng(len(letters))
    path = tmp_path / f"{name}.txt"
    path.write_text("".join(rng.choice(list(letters), size=4000)))
    return os.path.dirname(preprocess_files([str(path)], str(tmp_path / name), context, seed=3, progress=False,
                                            valid=valid))


@pytest.fixture
def two_sets(tmp_path):
    return make_set(tmp_path, "web", "abcdefgh ", valid=8), make_set(tmp_path, "code", "{}();=xy\n", valid=8)


def global_rows(loader_factory, steps: int, dp: int) -> list[torch.Tensor]:
    """The global batches of ``steps`` steps, the DP ranks' slices put back together."""
    loaders = [loader_factory(r, dp) for r in range(dp)]
    return [torch.cat([mb.input_ids for ld in loaders for mb in ld.next_batch()]) for _ in range(steps)]


def test_sources_follow_their_own_order_in_weighted_shares(two_sets):
    web, code = two_sets
    mix = MixtureDataset(f"web={web}:0.7,code={code}:0.3", verify=True, seed=5)
    assert mix.counts == slot_counts([0.7, 0.3]) == [7000, 3000]
    g = np.arange(20000)
    src, local = mix.source_of(g)
    for k, ds in enumerate(mix.datasets):
        # each source reads 0, 1, 2, ... of its own stream (its own shuffle, then its epochs) in order
        assert np.array_equal(local[src == k], np.arange(int((src == k).sum())))
        assert np.array_equal(mix.instances(g[src == k][:50]), ds.instances(np.arange(50)))
    assert abs(float((src[:1000] == 0).mean()) - 0.7) < 0.06  # the shares hold within a short window too
    # a function of the seed: another seed, another interleave
    assert not np.array_equal(MixtureDataset(f"web={web}:0.7,code={code}:0.3", seed=6).source_of(g)[0], src)


@pytest.mark.parametrize("stop,dp2,micro2", [(1, 2, 1), (3, 4, 2), (2, 1, 4)])
def test_mixture_resumes_exactly_on_another_dp_layout(two_sets, stop, dp2, micro2):
    web, code = two_sets
    spec = f"web={web}:0.6,code={code}:0.4"
    mix = MixtureDataset(spec, seed=1)
    full = global_rows(lambda r, d: ShardedLoader(mix, 8, 2, dp_rank=r, dp_size=d), 6, 2)
    first = ShardedLoader(mix, 8, 2, dp_rank=0, dp_size=2)
    for _ in range(stop):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))

    def resumed(r, d):
        ld = ShardedLoader(MixtureDataset(spec, seed=1), 8, micro2, dp_rank=r, dp_size=d)
        ld.load_state_dict(state)
        return ld

    rest = global_rows(resumed, 6 - stop, dp2)
    assert all(torch.equal(a, b) for a, b in zip(full[stop:], rest))
    with pytest.raises(ValueError, match="different data set"):  # other weights: another mixture
        ShardedLoader(MixtureDataset(f"web={web}:0.5,code={code}:0.5", seed=1), 8).load_state_dict(state)


def test_a_single_path_reads_as_before(two_sets):
    web, _ = two_sets
    from trainer.data import open_dataset

    assert isinstance(open_dataset(web), ShardedDataset)
    a = ShardedLoader(open_dataset(web), 8).next_batch()
    b = ShardedLoader(web, 8).next_batch()
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))


def test_mixture_run_logs_each_sources_validation_loss_and_resumes_exactly(two_sets, tmp_path, capsys):
    web, code = two_sets
    spec = f"web={web}:0.7,code={code}:0.3"
    over = dict(data__path=spec, eval__interval=2)
    full = Trainer(small_cfg("", str(tmp_path / "full"), steps=4, **over))
    head = startup_summary(full)
    assert "data: mixture of web 0.7 (70.0% of instances" in head and "code 0.3 (30.0% of instances" in head
    full_hist = full.fit()
    part_cfg = small_cfg("", str(tmp_path / "part"), steps=4, checkpoint__interval=2, **over)
    Trainer(part_cfg).fit(steps=2)
    resumed = Trainer(part_cfg)
    hist = resumed.fit()
    assert [r["loss"] for r in hist] == [r["loss"] for r in full_hist[2:]]
    assert resumed.loader.state_dict() == full.loader.state_dict()
    recs = [r for r in read_metrics(str(tmp_path / "full" / "metrics.jsonl")) if "val_loss" in r]
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        w, c = r["val_loss/web"], r["val_loss/code"]
        assert w != c and r["val_loss"] == pytest.approx(0.7 * w + 0.3 * c, rel=1e-12)
    out = capsys.readouterr().out
    assert "validation loss web " in out and "validation loss code " in out


def test_mixture_scalars_reach_tensorboard(two_sets, tmp_path):
    from trainer.records.tb_writer import record_scalars

    tags = dict(record_scalars({"step": 2, "val_loss": 1.0, "val_loss/web": 0.9, "val_loss/code": 1.2}))
    assert tags["val_loss/web"] == 0.9 and tags["val_loss/code"] == 1.2


def test_loss_chart_has_a_line_per_source():
    from trainer.records.metrics import loss_figure

    recs = [{"step": s, "loss": 3.0 - s / 10, "val_loss": 2.9, "val_loss/web": 2.8, "val_loss/code": 3.1}
            for s in (1, 2)]
    fig = loss_figure(recs)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "validation loss web" in labels and "validation loss code" in labels


@pytest.mark.parametrize("spec,match", [
    ("web={web}:-1,code={code}:1", "weight '-1'; give a number >= 0"),
    ("web={web}:0,code={code}:0", "add up to 0; give at least one source a weight > 0"),
    ("web={web}:lots,code={code}:1", "weight 'lots'; give a number >= 0"),
    ("web={web}:nan,code={code}:1", "weight 'nan'"),
    ("web={web}:1,web={code}:1", "names source 'web' twice"),
    ("web={web},code={code}:1", "is not NAME=PATH:WEIGHT"),
])
def test_bad_mixtures_are_refused(two_sets, spec, match):
    web, code = two_sets
    with pytest.raises(ConfigError, match=match):
        parse_mixture(spec.format(web=web, code=code))


def test_the_messages_name_the_real_cause(two_sets, tmp_path):
    """A path with a comma (commas split the entries), and a source whose older manifest records no
    end-of-document id (the same tokenizer otherwise), each said as what it is."""
    web, code = two_sets
    with pytest.raises(ConfigError, match="'p=data/a' is not NAME=PATH:WEIGHT .commas separate the entries, so a "
                                          "path cannot hold one"):
        parse_mixture("p=data/a,b:1")
    old = tmp_path / "old"
    shutil.copytree(code, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["tokenizer"]["eos_id"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=f"source 'old' .{old}. records no end-of-document id .*make it again "
                                          "with fastmoe-preprocess") as e:
        MixtureDataset(f"web={web}:1,old={old}:1", verify=False)
    assert "different tokenizer" not in str(e.value)


def test_missing_set_and_other_context_are_refused_before_the_model(two_sets, tmp_path):
    web, code = two_sets
    short = make_set(tmp_path, "short", "abc", context=8)
    with pytest.raises(ConfigError, match="source 'math'.*does not exist; run fastmoe-preprocess"):
        MixtureDataset(f"web={web}:1,math={tmp_path / 'nope'}:1")
    with pytest.raises(ConfigError, match="'web' and 'short' have different context .16 vs 8.; preprocess them"):
        MixtureDataset(f"web={web}:1,short={short}:1")


def test_cli_refuses_a_bad_mixture_in_one_line(two_sets, tmp_path):
    web, code = two_sets
    r = subprocess.run([sys.executable, "-m", "trainer", "--data", f"web={web}:1,web={code}:2", "--steps", "1",
                        "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "names source 'web' twice; give each source its own name" in lines[0]
