"""The paged cache a model owns: one page pytree per attention layer, the MTP layer's last.

Each attention module declares its own pages (`GqaPages(k, v)`, `MlaPages(latent, index_keys)`)
and creates them (`init_pages`); the model collects them into a `ModelCache` (`init_cache`). All
layers share one page pool and one block table per request: page `p` of every layer holds the
same tokens. Serving hands out pages (the block allocator) and maps tokens to slots; it never
looks inside a layer's pages nor needs to know where the draft layer's pages are.
"""

import dataclasses
from typing import Protocol

import jax


class Pages(Protocol):
  """What every attention layer's page pytree provides."""

  @property
  def num_pages(self) -> int:
    """Pages in the pool."""
    ...

  @property
  def page_size(self) -> int:
    """Token slots per page."""
    ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
  """Paged cache of a whole model.

  `layers[i]` are decoder layer i's pages; `draft` the MTP layer's, or None when the cache was
  made without speculation. The MTP cache is indexed by the position of the target hidden state a
  row consumes, so its valid length always equals the target's committed length.
  """

  layers: tuple[Pages, ...]
  draft: Pages | None = None

  @property
  def num_pages(self) -> int:
    """Pages in the pool (every layer's pool has as many)."""
    return self.layers[0].num_pages

  @property
  def page_size(self) -> int:
    """Token slots per page (the same in every layer)."""
    return self.layers[0].page_size

  def replace(self, **changes) -> "ModelCache":
    """A copy with the given fields replaced."""
    return dataclasses.replace(self, **changes)
