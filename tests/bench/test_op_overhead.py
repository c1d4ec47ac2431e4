"""``python -m bench op_overhead`` runs and reports the three ways of calling one op."""
from bench.studies import op_overhead


def test_op_overhead_reports_each_registration(capsys):
    op_overhead.main(["--rounds", "2", "--calls", "2"])
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ")[1].strip() for line in lines[1:] if line.strip()]
    assert names == ["custom_op + register_autograd", "library fragment + autograd.Function", "body alone"]
    assert all(" us" in line for line in lines[1:])
