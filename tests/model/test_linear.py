"""Prepacked linear layers give exactly what F.linear gives."""

import pytest
import torch
import torch.nn.functional as F

from tests.model.onednn import needs_packing
from tokenweir.model import linear as linear_module
from tokenweir.model.linear import Linear, can_prepack


@needs_packing
@pytest.mark.parametrize("rows", [2, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_is_bit_identical(rows, with_bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    linear = Linear(weight, bias)
    assert linear.packed
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight, bias))


def test_bf16_keeps_f_linear_where_onednn_cannot_pack_it(monkeypatch):
    # On such a CPU the reorder raises: --dtype bfloat16 must still load and compute.
    monkeypatch.setattr(linear_module, "_onednn_packs_bf16", lambda: False)
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    linear = Linear(weight)
    assert not linear.packed
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight))


def test_float32_is_not_prepacked():
    # fp32 stays on F.linear, the kernel transformers uses, so greedy fp32 output is token-exact.
    weight = torch.randn(8, 4)
    assert not can_prepack(weight)
    linear = Linear(weight)
    x = torch.randn(3, 4)
    assert torch.equal(linear(x), F.linear(x, weight))


@needs_packing
def test_one_row_is_computed_like_a_row_of_a_batch():
    # The default model's down projection: a shape where oneDNN's one-row kernel rounds some
    # outputs differently from its batched one (on small weights the two may agree anyway).
    # A batch of 32: on the Intel Xeon with AMX measured here, rows past the 32nd of a larger
    # batch are another kernel's, which differs from the row alone whatever linear.py does
    # (onednn.py).
    torch.manual_seed(0)
    linear = Linear(torch.randn(576, 1536, dtype=torch.bfloat16) * 0.05)
    x = torch.randn(32, 1536, dtype=torch.bfloat16)
    batch = linear(x)
    for row in range(x.shape[0]):
        assert torch.equal(linear(x[row : row + 1]), batch[row : row + 1]), f"row {row}"
