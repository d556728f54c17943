"""The torch-free model description: importable without torch, KV sizes equal to the real
cache's, and no import cycle among the model's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tokenweir.model
from tokenweir.model.arch import arch_from_hf_folder, element_size, kv_cache_bytes_per_block
from tokenweir.model.attention import allocate_kv_caches


def test_arch_sizes_a_pool_with_torch_blocked(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tokenweir.model.arch import arch_from_hf_folder, kv_cache_bytes_per_block\n"
        f"arch = arch_from_hf_folder({folder!r})\n"
        "print(arch.kv_bytes_per_token('bf16'), kv_cache_bytes_per_block(arch, 16, 'float32'))\n"
        "assert not [m for m in sys.modules if m.startswith('torch') and sys.modules[m] is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    arch = arch_from_hf_folder(folder)
    per_token = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2
    assert result.stdout.split() == [str(per_token), str(16 * 2 * per_token)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_sizes_equal_the_allocated_cache(tiny_model_dir, dtype):
    arch = arch_from_hf_folder(tiny_model_dir("llama"))
    caches = allocate_kv_caches(arch, 10, 16, dtype, "cpu")
    allocated = sum(c.numel() * c.element_size() for c in caches)
    name = str(dtype).removeprefix("torch.")
    for given in (dtype, name, str(dtype), dtype.itemsize):
        assert kv_cache_bytes_per_block(arch, 16, given) * 10 == allocated
        assert arch.kv_bytes_per_token(given) * 16 * 10 == allocated


def test_element_size_names():
    assert [element_size(n) for n in ("fp32", "BF16", "half", "torch.float16", 4)] == [4, 2, 2, 2, 4]
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        element_size("int8")


def _model_imports(path: Path) -> set[str]:
    """The tokenweir.model modules a module imports, at any level (TYPE_CHECKING included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenweir.model"):
            if node.module == "tokenweir.model":
                found |= {f"tokenweir.model.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tokenweir.model.")}
    return found


def test_model_modules_import_no_cycle():
    root = Path(tokenweir.model.__file__).parent
    graph = {f"tokenweir.model.{p.stem}": _model_imports(p) for p in root.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert "tokenweir.model.arch" in graph and not graph["tokenweir.model.arch"]  # the description imports none
