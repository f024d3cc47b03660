"""Zero-copy layout normalisation."""

from __future__ import annotations

import pytest
import torch

from lmshm.platform.contiguity import contiguous_permutation, require_dense, to_contiguous_view


def test_contiguous_tensor_is_returned_unchanged():
    t = torch.zeros(2, 3, 4)
    assert to_contiguous_view(t) is t


def test_nhd_view_over_hnd_storage_recovers_the_hnd_layout_without_copying():
    # storage: [2 (k/v), blocks, heads, block_size, head_dim]; the engine sees NHD.
    hnd = torch.randn(2, 8, 4, 16, 32)
    nhd = hnd.permute(0, 1, 3, 2, 4)
    assert not nhd.is_contiguous()
    view = to_contiguous_view(nhd)
    assert view.is_contiguous()
    assert view.data_ptr() == hnd.data_ptr()
    assert torch.equal(view, hnd)
    assert contiguous_permutation(nhd) == (0, 1, 3, 2, 4)


def test_size_one_dimensions_do_not_break_normalisation():
    t = torch.randn(1, 6, 1, 5).permute(3, 0, 1, 2)
    view = to_contiguous_view(t)
    assert view.is_contiguous() and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 8)[:, ::2],  # gaps
        lambda: torch.randn(4, 1).expand(4, 8),  # broadcast (stride 0)
        lambda: torch.randn(10, 10)[2:5, 1:4],  # interior slice with gaps
    ],
)
def test_layouts_that_need_a_copy_are_refused_with_shape_stride_and_offset(make):
    t = make()
    with pytest.raises(ValueError) as info:
        to_contiguous_view(t)
    msg = str(info.value)
    assert f"shape={tuple(t.shape)}" in msg
    assert f"stride={tuple(t.stride())}" in msg
    assert f"storage_offset={t.storage_offset()}" in msg


def test_require_dense_names_the_layer_and_refuses_empty_tensors():
    with pytest.raises(ValueError, match="model.layers.7"):
        require_dense(torch.randn(4, 8)[:, ::2], "model.layers.7")
    with pytest.raises(ValueError, match="empty"):
        require_dense(torch.empty(0, 4), "x")
