"""The public face: __all__ is sorted and names exactly the public names."""

from __future__ import annotations

import asyncbatch as ab


def test_all_is_sorted_and_complete() -> None:
    for name in ab.__all__:  # names load on first use: each must resolve
        assert getattr(ab, name) is not None, name
    assert set(dir(ab)) >= set(ab.__all__)
    public = {
        name
        for name, value in vars(ab).items()
        if not name.startswith("_") and not getattr(value, "__file__", None)
    }
    assert ab.__all__ == sorted(ab.__all__)
    assert set(ab.__all__) == public - {"annotations"}
