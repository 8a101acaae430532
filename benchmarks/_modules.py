"""Another version of an op's Mosaic GPU module, loaded beside the installed one."""

import importlib.util
import pathlib


def load_module(path: str | None, installed):
  """The op's Mosaic GPU module: ``installed``, or the version in the file ``path`` (a branch's
  ``mosaic_gpu.py``, say, written out by ``git show``), loaded as a module of its own."""
  if path is None:
    return installed
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
