"""Single-process checks of the all-to-all's input validation (a group of one rank is ``None``)."""

import pytest

torch = pytest.importorskip("torch")

from megatron_flexsp.runtime.all_to_all import head_to_seq, seq_to_head  # noqa: E402


def test_size_one_group_is_identity_and_differentiable():
    x = torch.randn(5, 4, 3, requires_grad=True)
    y = seq_to_head(x, group=None, token_counts=[5])
    z = head_to_seq(y, group=None, token_counts=[5])
    z.sum().backward()
    assert torch.equal(z, x) and torch.equal(x.grad, torch.ones_like(x))


def test_bad_inputs_raise_with_numbers():
    x = torch.randn(5, 4, 3)
    with pytest.raises(ValueError, match="token_counts has 2 entries but the group has 1 ranks"):
        seq_to_head(x, group=None, token_counts=[5, 5])
    with pytest.raises(ValueError, match="this rank holds 5 tokens, token_counts says 6"):
        seq_to_head(x, group=None, token_counts=[6])
    with pytest.raises(ValueError, match="got 5 tokens, token_counts sum to 4"):
        head_to_seq(x, group=None, token_counts=[4])
