"""`tokenweir simulate` runs where torch is absent: a capacity planner needs no model runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Any import of torch (or transformers, which needs it) fails, as in an environment without it.
BLOCK_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, _Block())
from tokenweir.cli import main
main(sys.argv[1:])
"""


def test_simulate_and_search_import_no_torch(tmp_path) -> None:
    workload = ["--dataset-name", "random", "--num-prompts", "20", "--request-rate", "2",
                "--random-input-len", "100", "--random-output-len", "20"]
    for argv in (["simulate", *workload, "--disable-tqdm"], ["simulate", "search", *workload, "--goodput", "ttft:2000",
                                           "--search-iterations", "1"]):
        done = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        assert done.returncode == 0, done.stderr[-2000:]
        assert "SIMULATED" in done.stdout
