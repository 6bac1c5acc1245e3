"""A pytest plugin: where the CPU suite's time goes in XLA compiles, from jax's own monitoring events
(noise-free, unlike wall time on a shared 2-core machine).

  PYTHONPATH=bench python -m pytest -q -p no:cacheprovider -p pytest_compile_time tests/test_x.py

At the end: per event, the count and summed seconds (backend compiles, lowering, tracing; the persistent
compilation cache's hits and seconds saved when one is configured), then the 15 tests with the most backend
compile seconds (summed over compile threads; fixture setup counts toward the first test that needs it).
"""

import collections

from jax._src import monitoring

_count, _secs = collections.Counter(), collections.Counter()
_per_test = collections.Counter()
_current = ["(collection)"]


def _event(name, **kw):
  _count[name] += 1


def _duration(name, secs, **kw):
  _count[name] += 1
  _secs[name] += secs
  if name == "/jax/core/compile/backend_compile_duration":
    _per_test[_current[0]] += secs


monitoring.register_event_listener(_event)
monitoring.register_event_duration_secs_listener(_duration)


def pytest_runtest_logstart(nodeid, location):
  _current[0] = nodeid


def pytest_terminal_summary(terminalreporter):
  w = terminalreporter.write_line
  w("compile events (count, seconds):")
  for name in sorted(_count):
    if any(s in name for s in ("compil", "cache", "trace", "mlir")):
      w(f"  {name}: {_count[name]} {_secs[name]:.1f}")
  w("backend compile seconds per test:")
  for nodeid, s in _per_test.most_common(15):
    w(f"  {s:7.1f}  {nodeid}")
