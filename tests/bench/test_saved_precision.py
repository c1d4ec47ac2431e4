"""``bench.studies.saved --precision``: what a quantized block keeps for its backward, measured."""
from __future__ import annotations

import pytest
import torch

from bench.harness.presets import PRESETS
from bench.studies.saved import _config, _table, precision_bytes, saved
from fastmoe_xpu import FastSparseMoeBlock


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_block_saves_what_fp32_saves_plus_weight_codes(precision):
    from fastmoe_xpu.kernels.quantized.core import unsupported_reason

    reason = unsupported_reason(precision, "cpu", torch.float32)
    if reason is not None:  # fp8: torch 2.11's CPU _scaled_mm takes per-tensor scales only
        pytest.skip(reason)
    p = PRESETS["tiny"]
    torch.manual_seed(0)
    block = FastSparseMoeBlock(_config(p), backend="torch")
    x = torch.randn(1, 37, p.hidden)
    fp32 = saved(block, x.clone().requires_grad_())[0]
    got, codes = precision_bytes(p, block, x, precision)
    # the activation codes are made again in the backward: the saved tensors are fp32's, byte for byte
    assert got == fp32 > 0
    # one byte per expert weight (gate/up [E, 2I, H] and down [E, H, I]) and an fp32 scale per output channel
    E, H, I = p.local_experts, p.hidden, p.intermediate
    assert codes == E * (2 * I * H + H * I) + 4 * E * (2 * I + H)


def test_table_lines_up_every_column_with_its_title():
    row = {"preset": "tiny", "T": 33, "dense": 3 << 20, "metadata": 1 << 19, "fastmoe": 7 << 20, "hf": 14 << 20,
           "int8": 1 << 20, "int8_weight_codes": 1 << 18, "fb_new": 0.25, "fb_base": 0.5}
    header, line = _table([row], ["int8"], timed=True)
    assert len(header) == len(line)
    # right-aligned columns end where their titles end; a missing --base reads nan
    assert header.index("T") == line.index(" 33") + 2
    assert line[header.index("base MiB") + len("base MiB") - 3:].startswith("nan")
    assert header.endswith("new/base") and line.endswith("0.500")
    assert line.split() == ["tiny", "33", "3.00", "0.500", "7.00", "2.000", "nan", "14.00", "0.500", "1.00", "0.25",
                            "0.250", "0.500", "0.500"]
