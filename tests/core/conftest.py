from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from tests.core.helpers import assert_kv_released, assert_no_leaks, assert_pool_released, create_scheduler
from tokenweir.core.block_pool import BlockPool
from tokenweir.core.cost_model import step_composition
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.scheduler import Scheduler


@pytest.fixture(autouse=True)
def _step_tally_is_exact(monkeypatch):
    """In every test here: the tally the scheduler keeps while it builds a step (what policies
    read in may_admit) is the step's composition counted afresh from its output, after every
    admission, preemption, swap and top-up the step made."""
    make_output = Scheduler._make_output

    def checked(self, step):
        out = make_output(self, step)
        assert step.tally.composition() == step_composition(out, self.requests), f"step {out.step_id}"
        return out

    monkeypatch.setattr(Scheduler, "_make_output", checked)


def _checked_factory(build: Callable[..., Any], check: Callable[[Any], None]) -> Iterator[Callable[..., Any]]:
    """A factory whose every product is checked for leaks when the test ends."""
    created = []

    def factory(*args, **kwargs):
        created.append(build(*args, **kwargs))
        return created[-1]

    yield factory
    for thing in created:
        check(thing)


@pytest.fixture
def make_scheduler():
    yield from _checked_factory(create_scheduler, assert_no_leaks)


@pytest.fixture
def make_kv():
    yield from _checked_factory(KVCacheManager, assert_kv_released)


@pytest.fixture
def make_pool():
    yield from _checked_factory(BlockPool, assert_pool_released)
