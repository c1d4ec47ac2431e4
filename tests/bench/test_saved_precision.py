"""``bench.saved --precision``: what a quantized block keeps for its backward, measured."""
from __future__ import annotations

import pytest
import torch

from bench.presets import PRESETS
from bench.saved import _config, precision_bytes, saved
from fastmoe_xpu import FastSparseMoeBlock


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_block_saves_what_fp32_saves_plus_weight_codes(precision):
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
