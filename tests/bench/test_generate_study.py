"""``fastmoe-bench generate`` at a micro size: a row per (family, size, precision, batch, threads) with the
three implementations' times, the speedup computed from them, the first call's ratio and the token check;
the table and a JSON beside it written with ``--out``; a bad option is one line, exit 2."""
import json

import pytest

from bench.studies import generate


def test_generate_prints_a_row_per_configuration_with_equal_tokens(tmp_path, capsys):
    out = tmp_path / "gen.md"
    rc = generate.main(["--families", "qwen3_moe", "--sizes", "micro", "--precisions", "fp32", "int8",
                        "--batch", "1", "2", "--rounds", "2", "--prompt", "3", "--new-tokens", "4", "--no-progress",
                        "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "matrix extensions" in text  # the machine line names the CPU's vector/matrix extensions
    rows = [line for line in text.splitlines() if line.startswith("| qwen3_moe |")]
    assert len(rows) == 4, rows  # fp32 and int8, batch 1 and 2
    fp32 = [r for r in rows if "| fp32 |" in r]
    assert all(r.rstrip().endswith("| yes |") for r in fp32), fp32  # fastmoe's tokens are transformers'
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [(r["precision"], r["batch"]) for r in saved["rows"]] == [("fp32", 1), ("fp32", 2), ("int8", 1),
                                                                    ("int8", 2)]
    for r in saved["rows"]:
        assert r["median"] > 0 and r["lo"] <= r["median"] <= r["hi"] and r["first_ratio"] > 0
        # int8 runs against both float peers, fp32 against transformers' two implementations
        assert len(r["peers_ms"]) == (4 if r["precision"] == "int8" else 2)
        if r["precision"] == "fp32":
            assert r["tokens_agree"] == 1.0 and r["peers_agree"]
        else:
            assert 0.0 <= r["tokens_agree"] <= 1.0
    assert out.read_text().count("| qwen3_moe |") == 4


def test_speedup_is_the_faster_peer_of_each_round_over_ours():
    s = generate.speedup({"fastmoe": [2.0, 1.0], "a": [4.0, 1.0], "b": [3.0, 3.0]}, "fastmoe", ["a", "b"])
    assert (s["lo"], s["hi"], s["median"]) == (1.0, 1.5, 1.25) and s["of_minimums"] == 1.0


def test_bad_option_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        generate.main(["--families", "nonesuch"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
