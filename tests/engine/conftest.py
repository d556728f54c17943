from __future__ import annotations

import pytest

from tests.engine.helpers import assert_engine_released


@pytest.fixture
def make_llm():
    """LLM factory whose engines are leak-checked when the test ends."""
    from tokenweir import LLM

    created = []

    def factory(model, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        llm = LLM(model, **kwargs)
        created.append(llm)
        return llm

    yield factory
    for llm in created:
        assert_engine_released(llm.engine)
