"""Block allocator bookkeeping and slot mapping."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.serving.kv_cache import BlockAllocator, OutOfPagesError, slot_mapping


def test_allocate_free_and_reuse():
  allocator = BlockAllocator(6, page_size=4)
  first = allocator.allocate(4)
  assert len(set(first)) == 4 and allocator.num_free == 2
  with pytest.raises(OutOfPagesError, match="need 3 pages but only 2"):
    allocator.allocate(3)
  allocator.free(first[:2])
  second = allocator.allocate(4)
  assert not set(second) & set(first[2:]) and allocator.num_free == 0
  assert allocator.pages_for(9) == 3


def test_double_free_is_rejected():
  allocator = BlockAllocator(2, page_size=4)
  pages = allocator.allocate(1)
  allocator.free(pages)
  with pytest.raises(ValueError, match="not allocated"):
    allocator.free(pages)


def test_shuffled_allocator_hands_out_a_permutation():
  allocator = BlockAllocator(32, page_size=2, shuffle_seed=0)
  pages = allocator.allocate(32)
  assert sorted(pages) == list(range(32)) and pages != list(range(32))


def test_slot_mapping():
  block_tables = jnp.array([[5, 2, 9], [1, 0, 3]], jnp.int32)
  positions = jnp.array([[0, 3, 4, 8], [2, 5, -1, 12]], jnp.int32)
  valid = jnp.array([[True, True, True, True], [True, False, True, True]])
  slots = np.asarray(slot_mapping(block_tables, positions, valid, page_size=4))
  # page 5 offset 0, page 5 offset 3, page 2 offset 0, page 9 offset 0; invalid / negative /
  # past-the-table positions map to -1.
  np.testing.assert_array_equal(slots, [[20, 23, 8, 36], [6, -1, -1, -1]])
