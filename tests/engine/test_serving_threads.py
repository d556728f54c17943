"""`tokenweir serve` leaves one core to the event loop for small steps (serving_threads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenweir.engine import serving_threads
from tokenweir.engine.serving_threads import SMALL_STEP_MAX_TOKENS, before_step, reserve_core_for_serving


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    serving_threads._serving = None
    torch.set_num_threads(before)


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, threads: int) -> None:
    monkeypatch.setattr(serving_threads.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    torch.set_num_threads(threads)


def test_small_steps_leave_a_core_and_large_steps_use_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, cores=4, threads=4)
    assert reserve_core_for_serving() is not None
    before_step(1)
    assert torch.get_num_threads() == 3
    before_step(SMALL_STEP_MAX_TOKENS)
    assert torch.get_num_threads() == 3
    before_step(SMALL_STEP_MAX_TOKENS + 1)
    assert torch.get_num_threads() == 4
    before_step(0)
    assert torch.get_num_threads() == 3


def test_fewer_threads_than_cores_stay_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, cores=16, threads=2)
    assert reserve_core_for_serving() is None
    before_step(1)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("cores, omp", [(1, None), (4, "4")])
def test_a_single_core_or_an_explicit_omp_num_threads_is_left_alone(
        monkeypatch: pytest.MonkeyPatch, cores: int, omp: str | None) -> None:
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    _machine(monkeypatch, cores=cores, threads=min(cores, 4))
    assert reserve_core_for_serving() is None
    before_step(1)
    assert torch.get_num_threads() == min(cores, 4)


def test_offline_steps_keep_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, cores=2, threads=2)
    before_step(1)  # never enabled: LLM and library users of AsyncLLMEngine
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("in_process", [True, False])
def test_serve_enables_it_before_an_in_process_engine_starts(monkeypatch: pytest.MonkeyPatch,
                                                              in_process: bool) -> None:
    """Only an engine loop sharing the server's process gives up a core; an engine process of
    its own (serve's default) has no event loop next to it."""
    from tokenweir import cli
    from tokenweir.server import app

    _machine(monkeypatch, cores=2, threads=2)
    seen: list[object] = []
    monkeypatch.setattr(app, "run_server", lambda _args, _ns: seen.append(serving_threads._serving))
    cli.main(["serve", "--port", "0", *(["--engine-in-process"] if in_process else [])])
    assert len(seen) == 1 and (seen[0] is not None) == in_process
