"""What oneDNN's bf16 linear path does on this CPU, for the tests whose claims depend on it."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tokenweir.model import linear as linear_module

# oneDNN packs bf16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (linear.py).
needs_packing = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and linear_module._onednn_packs_bf16()),
    reason="oneDNN's bf16 linear path does not run on this CPU")


@cache
def batched_rows_invariant() -> bool:
    """Whether oneDNN computes every row of a bf16 batch as it computes that row alone, at the
    default model's down-projection shape, for batches of 2 to 300 rows. Measured true on an AMD
    EPYC with AVX-512; false on an Intel Xeon with AMX, where rows past the 32nd of a 33- to
    300-row batch differ in the last bit (another kernel takes them)."""
    if not (torch.backends.mkldnn.is_available() and linear_module._onednn_packs_bf16()):
        return False
    generator = torch.Generator().manual_seed(0)
    linear = linear_module.Linear(torch.randn(576, 1536, generator=generator).to(torch.bfloat16) * 0.05)
    x = torch.randn(300, 1536, generator=generator).to(torch.bfloat16)
    alone = torch.cat([linear(x[row:row + 1]) for row in range(300)])
    return all(torch.equal(linear(x[:n]), alone[:n]) for n in (2, 33, 64, 300))


needs_row_invariant_batches = pytest.mark.skipif(
    not batched_rows_invariant(),
    reason="oneDNN's bf16 kernel computes some rows of a batch differently from the same row alone on this CPU")
