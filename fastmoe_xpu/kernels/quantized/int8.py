"""The ``int8`` stage-4 implementation: the quantized launchers (:mod:`.launchers`) with the ``int8`` format."""
from __future__ import annotations

from . import launchers as _l
from .launchers import LAUNCHERS

FORMAT = "int8"


def gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH):  # noqa: ANN001, ANN201
    return _l.gate_up_fwd(FORMAT, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)


def down_fwd(h_RI, cum_token_counts, w_down_NHI, transposed=False):  # noqa: ANN001, ANN201
    return _l.down_fwd(FORMAT, h_RI, cum_token_counts, w_down_NHI, transposed)


def down_bwd(dy_RH, h_RI, cum_token_counts, w_down_NHI, transposed=False):  # noqa: ANN001, ANN201
    return _l.down_bwd(FORMAT, dy_RH, h_RI, cum_token_counts, w_down_NHI, transposed)


def down_weighted_bwd(dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI):  # noqa: ANN001, ANN201
    return _l.down_weighted_bwd(FORMAT, dy_RH, gate_up_R2I, row_weights_R, cum_token_counts, w_down_NHI)


def gate_up_bwd(d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH):  # noqa: ANN001, ANN201
    return _l.gate_up_bwd(FORMAT, d_gate_up_R2I, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)


__all__ = ["FORMAT", "LAUNCHERS", *LAUNCHERS]
