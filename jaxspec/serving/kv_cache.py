"""Paged KV cache bookkeeping: the host-side block allocator and the token -> slot mapping.

The cache arrays themselves belong to the model (`model.init_cache`, `jaxspec.model.cache`): every
layer's pages share one page pool. A request owns a list of pages, its block table row; token `t`
of the request lives at slot `block_table[t // page_size] * page_size + t % page_size` of every
layer. The arrays are written functionally inside jitted steps that donate them, so XLA updates
them in place.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


class OutOfPagesError(RuntimeError):
  """The cache has fewer free pages than a request needs."""


class BlockAllocator:
  """Hands out and takes back cache pages. Pure host-side bookkeeping; never touches the device.

  With `shuffle_seed` the free list starts in a random order, so that page tables are
  non-contiguous (tests use it to catch kernels that assume contiguous pages).
  """

  def __init__(self, num_pages: int, page_size: int, *, shuffle_seed: int | None = None):
    if num_pages <= 0 or page_size <= 0:
      raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
    self.num_pages = num_pages
    self.page_size = page_size
    free = list(range(num_pages))
    if shuffle_seed is not None:
      np.random.default_rng(shuffle_seed).shuffle(free)
    self._free = free[::-1]  # pop() from the end hands out free[0] first
    self._owned: set[int] = set()

  @property
  def num_free(self) -> int:
    """Pages not allocated."""
    return len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    """Pages that `num_tokens` tokens take."""
    return math.ceil(num_tokens / self.page_size)

  def allocate(self, num_pages: int) -> list[int]:
    """Takes `num_pages` free pages (in the pool's order, shuffled when a seed was given);
    `OutOfPagesError` when fewer are free, `ValueError` for a negative count."""
    if num_pages < 0:
      raise ValueError(f"num_pages must be >= 0, got {num_pages}")
    if num_pages > len(self._free):
      raise OutOfPagesError(
        f"need {num_pages} pages but only {len(self._free)} of {self.num_pages} are free"
      )
    pages = [self._free.pop() for _ in range(num_pages)]
    self._owned.update(pages)
    return pages

  def free(self, pages: list[int]) -> None:
    """Returns `pages` to the pool; a page that is not allocated is a `ValueError`."""
    for page in pages:
      if page not in self._owned:
        raise ValueError(f"page {page} is not allocated")
      self._owned.remove(page)
      self._free.append(page)


def slot_mapping(
  block_tables: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int
) -> jax.Array:
  """Flat cache slot of every token; -1 where `valid` is False.

  block_tables: int32 [B, max_pages]; positions: int32 [B, T]; valid: bool [B, T] -> int32 [B, T].
  """
  max_pages = block_tables.shape[1]
  page_index = jnp.clip(positions // page_size, 0, max_pages - 1)
  page = jnp.take_along_axis(block_tables, page_index, axis=1)
  slots = page * page_size + positions % page_size
  return jnp.where(valid & (positions >= 0) & (positions < max_pages * page_size), slots, -1)
