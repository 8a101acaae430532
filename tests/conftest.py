"""Shared test set-up: GPU-only tests are skipped on the CPU."""

import jax
import pytest


def _on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


def pytest_collection_modifyitems(config, items):
  if _on_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
