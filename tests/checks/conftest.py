"""The passing record every check test mutates (`records.make_record`)."""

from __future__ import annotations

import pytest

from harness.record import RunRecord

from .records import make_record


@pytest.fixture
def record() -> RunRecord:
    """A fresh record that passes every check."""
    return make_record()
