"""``python -m bench small_shapes``: one row per shape with every variant timed, and clear errors."""
import pytest

from bench.studies import small_shapes


def test_one_row_per_shape_with_every_variant(capsys):
    # transformers' grouped_mm wants 16-byte row strides: H and I multiples of 4 in fp32
    assert small_shapes.main(["--shapes", "5,8,4,4,2", "3,12,8,6,3", "--rounds", "1", "--reps", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1:6] for r in rows] == [[" 5 ", " 8 ", " 4 ", " 4 ", " 2 "], [" 3 ", " 12 ", " 8 ", " 6 ", " 3 "]]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # transformers, staged, padded and auto: forward / forward+backward, positive microseconds each
        for cell in cells[6:10]:
            fwd, fb = (float(v) for v in cell.split(" / "))
            assert fwd > 0 and fb > 0, row
        assert float(cells[10]) > 0 and float(cells[11]) > 0, row
        assert all(float(v) > 0 for v in cells[12].split(" / ")), row  # transformers over auto, F and F+B


@pytest.mark.parametrize("bad", ["5,8,4,4", "5,8,4,2,4", "5,8,x,4,2", "0,8,4,4,2"])
def test_bad_shapes_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        small_shapes.main(["--shapes", bad])
    err = capsys.readouterr().err
    assert "T,H,I,E,K" in err or "experts per token" in err, err
