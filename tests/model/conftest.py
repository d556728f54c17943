from __future__ import annotations

import pytest

from tests.model.tiny_models import ARCHS


@pytest.fixture(params=ARCHS)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    return request.param
