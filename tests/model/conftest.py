from __future__ import annotations

import pytest

from tests.model.tiny_models import ARCHS
from tokenweir.model import kernels


@pytest.fixture(params=ARCHS)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    """Run the block with the kernel disabled (the torch fallback)."""
    def run(fn):
        monkeypatch.setenv("TOKENWEIR_DISABLE_KERNELS", "1")
        kernels._library.cache_clear()
        try:
            return fn()
        finally:
            monkeypatch.delenv("TOKENWEIR_DISABLE_KERNELS")
            kernels._library.cache_clear()
    return run
