from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks
from tests.model.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model("qwen2") -> folder of a saved random-weight model (built once per session)."""
    built: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in built:
            built[arch] = make_tiny_model(str(tmp_path_factory.mktemp(f"engine-{arch}")), arch)
        return built[arch]

    return get


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
        assert_no_leaks(llm.engine.scheduler)
