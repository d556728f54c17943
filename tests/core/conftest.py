from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks, create_scheduler


@pytest.fixture
def make_scheduler():
    """`create_scheduler` whose every scheduler is leak-checked when the test ends."""
    created = []

    def factory(**kwargs):
        scheduler = create_scheduler(**kwargs)
        created.append(scheduler)
        return scheduler

    yield factory
    for scheduler in created:
        assert_no_leaks(scheduler)
