import platform

import pytest

from tokenweir.engine.cpu_allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc-specific tuning")
def test_glibc_accepts_the_malloc_tuning():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # once per process; later calls are free
