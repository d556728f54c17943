from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_model_dir("qwen2") -> path of a saved random tiny model (built once per session)."""
    # Imported here, not at the top: building a model needs torch, and tests/core runs without it.
    from tests.model.tiny_models import make_tiny_model

    built: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in built:
            built[arch] = make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch)
        return built[arch]

    return get
