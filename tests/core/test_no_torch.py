import subprocess
import sys

# The parts that must run where torch is absent (the simulator, the router): the scheduler core,
# the request and config records, and the model's description (which sizes KV pools).
TORCH_FREE = ("tokenweir", "tokenweir.config", "tokenweir.request", "tokenweir.core.scheduler", "tokenweir.model.arch")


def test_core_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            f"import {', '.join(TORCH_FREE)}\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
