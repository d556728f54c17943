"""Linear layers whose weights are prepacked once for the CPU's matmul library.

On the CPU in bfloat16, `F.linear` hands a plain row-major weight to oneDNN, which reorders it
into its blocked layout on every call. For the few rows of a decode step that copy costs about
as much as the multiply itself: packing the weight once at load makes decode-sized matmuls
1.2-1.9x faster here, with bit-identical results (same oneDNN kernel, same summation order).

A single row is multiplied as two: oneDNN takes another kernel for one row than for two or more
(measured: on the default model's weights the one-row result differs in the last bit, while
2 to 700 rows agree), so without this a request's logits, and so its seeded samples, would
depend on whether it decodes alone or in a batch. It costs a lone decode step ~3-6%. That
holds only where oneDNN computes every row of a batch alike: on an Intel Xeon with AMX (measured
2026-12-02), rows past the 32nd of a 33- to 300-row batch differ in the last bit from the same
row alone, so there bf16 seeded samples may depend on the batch (as in vLLM without its
batch-invariant mode); fp32, the path checked against transformers, does not use oneDNN.

oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere
(an AMD EPYC without AVX-512 here) its reorder raises, so bf16 keeps `F.linear` there, found
once by packing a tiny weight: `--dtype bfloat16` then still loads, slower, and without the
one-row batch invariance above.

Float32 keeps `F.linear` (MKL's sgemm, the path transformers takes on the CPU) so that greedy
fp32 output stays token-exact against transformers; CUDA keeps `F.linear` too (cuBLAS).
"""

from __future__ import annotations

from functools import cache
from typing import Optional

import torch
import torch.nn.functional as F

# oneDNN picks its blocking from an expected row count; decode batches are this order of size,
# and the choice barely matters for prefill-sized inputs (measured within noise).
_EXPECTED_ROWS = 64


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and _onednn_packs_bf16())


@cache
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN's bf16 linear path runs on this CPU (see the module docstring)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=torch.bfloat16), 2)
    except RuntimeError:
        return False
    return True


class Linear:
    """y = x @ weight.T (+ bias), prepacked when `can_prepack(weight)`."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.bias = bias
        self.packed = can_prepack(weight)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _EXPECTED_ROWS)
                       if self.packed else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if x.shape[0] == 1:  # see the module docstring: batch invariance
                return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.weight, self.bias,
                                                          "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
