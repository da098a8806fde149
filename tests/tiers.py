"""Which cases of a parametrized test the fast tier runs (the README's `not slow`); CI's second
step runs the rest. The fast tier keeps one case per code path, the slow one every variant."""

from __future__ import annotations

import pytest


def tiered(cases, fast, ids=None, *, unpack: bool = True) -> list:
    """`cases` (values, or tuples of several argnames' values where `unpack`) with those not
    among `fast` marked slow; `ids` (optional) names a case from its value, as parametrize's
    `ids=` would."""

    def param(case, marks):
        values = case if isinstance(case, tuple) and unpack else (case,)
        return pytest.param(*values, marks=marks, id=None if ids is None else ids(case))

    return [param(case, () if case in fast else pytest.mark.slow) for case in cases]
