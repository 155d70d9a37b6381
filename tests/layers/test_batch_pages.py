"""ForwardBatch's page checks: a batch built from python lists checks its pages on the host
(no device sync), a batch built from tensors on the device, with the same errors."""

from __future__ import annotations

import pytest
import torch

from hyla.contract import ForwardBatch


@pytest.mark.parametrize("as_tensor", [False, True])
def test_written_position_without_a_page_is_named(as_tensor):
    tables = [[4, -1], [2, 3]]  # sequence 0 writes positions 3..5 (page size 4): its column 1 is -1
    t = torch.tensor(tables) if as_tensor else tables
    batch = ForwardBatch.build([3, 1], [3, 6], t, [0, 1])
    assert ("host_tables" in batch._memo) is not as_tensor
    with pytest.raises(ValueError, match="no page"):
        batch.kv_slot_mapping(4)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_too_few_columns_is_named(as_tensor):
    tables = [[4], [2]]
    t = torch.tensor(tables) if as_tensor else tables
    batch = ForwardBatch.build([2, 1], [3, 0], t, [0, 1])
    with pytest.raises(ValueError, match="too few page columns"):
        batch.kv_slot_mapping(4)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_context_pages(as_tensor):
    tables = [[4, 7, -1], [2, -1, -1]]
    t = torch.tensor(tables) if as_tensor else tables
    batch = ForwardBatch.build([2, 1], [5, 3], t, [0, 1])
    assert batch.context_pages(0, 7, 4).tolist() == [4, 7]
    assert batch.kv_slot_mapping(4).tolist() == [7 * 4 + 1, 7 * 4 + 2, 2 * 4 + 3]
    with pytest.raises(ValueError, match="sequence 1 lacks a page"):
        batch.context_pages(1, 5, 4)
