"""Where tokenweir keeps what it builds once: converted GGUF models and compiled kernels."""

import os
from pathlib import Path


def cache_root() -> Path:
    """`TOKENWEIR_CACHE_DIR`, else ~/.cache/tokenweir."""
    root = os.environ.get("TOKENWEIR_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tokenweir"
