"""`tokenweir serve` leaves one core to the event loop (intra-op threads = cores - 1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenweir.engine import serving_threads
from tokenweir.engine.serving_threads import reserve_core_for_serving


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(serving_threads.os, "sched_getaffinity", lambda _pid: set(range(n)))


def test_one_core_is_left_to_the_serving_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    _cores(monkeypatch, 4)
    assert reserve_core_for_serving() == 3
    assert torch.get_num_threads() == 3


def test_a_single_core_keeps_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    _cores(monkeypatch, 1)
    assert reserve_core_for_serving() == 1


def test_fewer_threads_than_cores_are_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    _cores(monkeypatch, 16)
    assert reserve_core_for_serving() == 2


def test_an_explicit_omp_num_threads_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    torch.set_num_threads(4)
    _cores(monkeypatch, 4)
    assert reserve_core_for_serving() == 4


def test_serve_reserves_the_core_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenweir import cli
    from tokenweir.server import openai_api

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    _cores(monkeypatch, 2)
    seen: list[int] = []
    monkeypatch.setattr(openai_api, "run_server", lambda _args, _ns: seen.append(torch.get_num_threads()))
    cli.main(["serve", "--port", "0"])
    assert seen == [1]
