"""Every error pickles with its message and fields (only these cross a worker boundary)."""

from __future__ import annotations

import pickle

import pytest

import asyncbatch as ab
from asyncbatch import errors

STORE_ERRORS = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.StoreError)
]


@pytest.mark.parametrize("cls", STORE_ERRORS, ids=lambda c: c.__name__)
def test_store_errors_pickle_with_url_and_range(cls: type[errors.StoreError]) -> None:
    error = cls("read failed: s3://b/k bytes [0, 10)", "s3://b/k", 0, 10)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
    assert (copy.url, copy.start, copy.end) == ("s3://b/k", 0, 10)
    assert isinstance(copy, OSError | ab.AsyncBatchError)


def test_builtin_bases_let_callers_catch_by_kind() -> None:
    assert issubclass(ab.NotFoundError, FileNotFoundError)
    assert issubclass(ab.PermissionDeniedError, PermissionError)
    assert issubclass(ab.StoreTimeoutError, TimeoutError)
    assert issubclass(ab.ShortReadError, EOFError)
    assert issubclass(ab.ConfigError, ValueError)
    assert issubclass(ab.FormatError, ValueError)
    assert len(STORE_ERRORS) >= 10
