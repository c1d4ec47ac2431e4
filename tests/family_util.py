"""The transformers MoE families as pytest parameters: one per family, those that cannot be built
tiny as strict xfails with their reason (``fastmoe_xpu.integrations.families.NOT_BUILT_TINY``)."""
from __future__ import annotations

import pytest

from fastmoe_xpu.integrations.families import NOT_BUILT_TINY


def family_params(families) -> list:
    out = []
    for fam in families:
        marks = [pytest.mark.xfail(strict=True, reason=NOT_BUILT_TINY[fam.name])] if fam.name in NOT_BUILT_TINY else []
        out.append(pytest.param(fam.name, marks=marks, id=fam.name))
    return out
