import subprocess
import sys


def test_core_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tokenweir, tokenweir.config, tokenweir.request, tokenweir.core.scheduler\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
