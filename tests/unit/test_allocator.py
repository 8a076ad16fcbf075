import pytest

from splitserve.kv.allocator import BlockAllocator, OutOfBlocks


def test_lowest_ids_first_and_freed_ids_reused_before_untouched_ones():
    a = BlockAllocator(6)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) == [2, 3, 4]
    a.free([1, 0])
    assert a.allocate(3) == [1, 0, 5]
    assert (a.num_used, a.num_free) == (6, 0)


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
