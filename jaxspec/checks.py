"""Type predicates shared by the host-side argument checks (configs, engine, sampling).

Python and NumPy integers and floats count; bools do not, although Python treats them as ints.
"""

import numpy as np


def is_int(value) -> bool:
  """An integer (Python or NumPy), not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
  """An integer or a float (Python or NumPy), not a bool."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
    value, (bool, np.bool_)
  )
