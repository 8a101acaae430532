"""Fixtures of the kernel tests."""

import pytest
from races import races_found


@pytest.fixture(autouse=True)
def _forget_races_of_earlier_tests():
  """A test's `races_found()` answers for the kernels that test ran, not for earlier tests'."""
  races_found()
