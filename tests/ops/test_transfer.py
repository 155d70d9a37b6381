"""hyla.ops.transfer: host lists reach the device as exact int tensors, in one buffer."""

import pytest
import torch

from hyla.ops.transfer import fill_long, long_tensor, stage_long, to_device_long


def test_long_tensor_from_lists_rows_and_tensors():
    assert long_tensor([3, -1, 2**40]).tolist() == [3, -1, 2**40]
    assert long_tensor([[1, 2], [3, 4]]).shape == (2, 2)
    assert long_tensor([]).shape == (0,)
    assert long_tensor(torch.tensor([1, 2], dtype=torch.int32)).dtype == torch.long
    with pytest.raises(ValueError, match="equal lengths"):
        long_tensor([[1, 2], [3]])


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_stage_keeps_values_and_shapes(dtype):
    pieces = [[0, 5, 9], torch.arange(6).reshape(2, 3), [], [[7], [8]]]
    out = stage_long(pieces, "cpu", dtype=dtype)
    assert [t.shape for t in out] == [(3,), (2, 3), (0,), (2, 1)]
    assert all(t.dtype == dtype for t in out)
    assert out[0].tolist() == [0, 5, 9] and out[1].tolist() == [[0, 1, 2], [3, 4, 5]] and out[3].tolist() == [[7], [8]]
    # one buffer: every piece is a view of the same storage
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    # each piece starts on 16 bytes, whatever the lengths before it (one Triton variant, not two)
    assert all(t.data_ptr() % 16 == 0 for t in out)
    odd = stage_long([[1], [2, 3, 4], [5, 6, 7, 8, 9]], "cpu", dtype=dtype)
    assert all(t.data_ptr() % 16 == 0 for t in odd) and [t.tolist() for t in odd] == [[1], [2, 3, 4], [5, 6, 7, 8, 9]]


def test_to_device_long():
    assert to_device_long(list(range(5)), None).tolist() == [0, 1, 2, 3, 4]


def test_fill_long_writes_rows_into_an_existing_buffer():
    buf = torch.full((4, 3), -9, dtype=torch.long)
    fill_long(buf[:2], [[1, 2, 3], [4, 5, 6]])
    assert buf.tolist() == [[1, 2, 3], [4, 5, 6], [-9, -9, -9], [-9, -9, -9]]
    fill_long(buf[3], [7, 8, 9])
    assert buf[3].tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="equal lengths"):
        fill_long(buf[:2], [[1, 2, 3], [4]])
