"""A pytest plugin: where the CPU suite's time goes in XLA compiles, from jax's own monitoring events
(noise-free, unlike wall time on a shared 2-core machine).

  PYTHONPATH=bench python -m pytest -q -p no:cacheprovider -p pytest_compile_time tests/test_x.py

At the end: per event, the count and summed seconds (backend compiles, lowering, tracing; the persistent
compilation cache's hits and seconds saved when one is configured), then the 15 tests with the most backend
compile seconds (summed over compile threads; fixture setup counts toward the first test that needs it),
then per module: tests, backend compiles, compile seconds, wall seconds. With PYTEST_COMPILE_LOG=path set,
each module's line is also appended to that file as the module ends (a long run can be read while it goes).
"""

import collections
import os
import time

from jax._src import monitoring

_count, _secs = collections.Counter(), collections.Counter()
_per_test = collections.Counter()
_per_test_n = collections.Counter()
_current = ["(collection)"]
_module = ["(collection)", 0.0]  # the current module, its start time
_mod_stats = {}  # module -> [tests, compiles, compile s, wall s]


def _event(name, **kw):
  _count[name] += 1


def _duration(name, secs, **kw):
  _count[name] += 1
  _secs[name] += secs
  if name == "/jax/core/compile/backend_compile_duration":
    _per_test[_current[0]] += secs
    _per_test_n[_current[0]] += 1
    st = _mod_stats.setdefault(_module[0], [0, 0, 0.0, 0.0])
    st[1] += 1
    st[2] += secs


monitoring.register_event_listener(_event)
monitoring.register_event_duration_secs_listener(_duration)


def _end_module():
  mod, t0 = _module
  if mod in _mod_stats and t0:
    st = _mod_stats[mod]
    st[3] += time.monotonic() - t0
    path = os.environ.get("PYTEST_COMPILE_LOG")
    if path:
      with open(path, "a") as f:
        f.write(f"{mod} tests {st[0]} compiles {st[1]} compile_s {st[2]:.1f} wall_s {st[3]:.1f}\n")


def pytest_runtest_logstart(nodeid, location):
  _current[0] = nodeid
  mod = nodeid.split("::")[0]
  if mod != _module[0]:
    _end_module()
    _module[0], _module[1] = mod, time.monotonic()
  _mod_stats.setdefault(mod, [0, 0, 0.0, 0.0])[0] += 1


def pytest_terminal_summary(terminalreporter):
  _end_module()
  _module[1] = 0.0
  w = terminalreporter.write_line
  w("compile events (count, seconds):")
  for name in sorted(_count):
    if any(s in name for s in ("compil", "cache", "trace", "mlir")):
      w(f"  {name}: {_count[name]} {_secs[name]:.1f}")
  w("backend compile seconds (and compiles) per test:")
  for nodeid, s in _per_test.most_common(15):
    w(f"  {s:7.1f} {_per_test_n[nodeid]:5d}  {nodeid}")
  w("per module (tests, backend compiles, compile s, wall s):")
  for mod, (n, c, cs, ws) in sorted(_mod_stats.items(), key=lambda kv: -kv[1][2]):
    w(f"  {mod}: {n} tests, {c} compiles, {cs:.1f} s compiling, {ws:.1f} s")
