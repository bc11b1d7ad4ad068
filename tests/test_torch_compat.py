"""Every entry of labkit._torch_compat still does what labkit needs from the installed torch.

A failure here names the entry and the torch version: that is where an upgrade broke labkit."""

import re

import pytest
import torch

from labkit import _torch_compat as compat


def test_a_missing_private_api_is_a_clear_error_naming_the_torch_version():
    with pytest.raises(compat.TorchCompatError, match=re.escape(f"torch {torch.__version__} has no torch._no_such_api")):
        compat.private("torch", "_no_such_api")


def test_foreach_kernels_copy_subtract_and_norm_lists_of_tensors():
    before = [torch.zeros(3), torch.zeros(2, 2)]
    now = [torch.tensor([3.0, 4.0, 0.0]), torch.ones(2, 2)]
    compat.foreach_copy_(before, [t * 2 for t in now])
    assert torch.equal(before[0], torch.tensor([6.0, 8.0, 0.0]))
    deltas = compat.foreach_sub(before, now)
    assert [n.item() for n in compat.foreach_norm(deltas)] == pytest.approx([5.0, 2.0])
