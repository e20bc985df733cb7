"""treespark.linear: the CPU product layouts give F.linear's values, row-major."""

import pytest
import torch
import torch.nn.functional as F

from treespark.linear import SMALL_ROWS, Linear, linear, padded_rows


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 15, 16, 17, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(n, bias):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(n, 24, generator=g)
    y = linear(x, w, b)
    assert y.shape == (n, 40)
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_any_leading_shape_and_non_contiguous_input():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 8, generator=g)
    x = torch.randn(3, 8, 2, generator=g).transpose(1, 2)  # [3, 2, 8], column-major rows
    y = linear(x, w)
    assert y.shape == (3, 2, 12) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert linear(torch.zeros(0, 8), w).shape == (0, 12)


def test_padding_rules():
    assert padded_rows(1) == 2
    assert [padded_rows(n) for n in (2, 3, 8, 9)] == [2, 3, 8, 9]
    assert all(padded_rows(n) == 16 for n in range(10, 16))
    assert padded_rows(16) == 16 and padded_rows(SMALL_ROWS) == SMALL_ROWS


def test_linear_module_keeps_nn_linear_state_dict_and_gradients():
    a, b = Linear(6, 4), torch.nn.Linear(6, 4)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(3, 6, requires_grad=True)
    a(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    b(x).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(a.weight.grad, b.weight.grad)
