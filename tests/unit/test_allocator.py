import pytest

from splitserve.kv.allocator import BlockAllocator, OutOfBlocks


def test_lowest_free_ids_first_in_ascending_order():
    a = BlockAllocator(8)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) == [2, 3, 4]
    a.free([3, 1, 0])
    assert a.allocate(4) == [0, 1, 3, 5]
    a.free([5, 2])
    assert a.allocate(2) == [2, 5]
    assert (a.num_used, a.num_free) == (6, 2)


def test_out_of_blocks_allocates_nothing():
    a = BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    assert a.num_free == 1


def test_double_free_and_foreign_ids_raise():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free(ids)
    with pytest.raises(ValueError):
        a.free(ids)
    with pytest.raises(ValueError):
        a.free([3])
    assert a.num_free == 4
