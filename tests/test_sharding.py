"""Tensor parallelism (models/sharding.py): the 4-device checks run in a subprocess
(tests/sharded_cases.py), since XLA_FLAGS must be set before jax is imported; the argument checks
that need no second device run here."""

import os
import pathlib
import subprocess
import sys

import pytest

from models import sharding

HERE = pathlib.Path(__file__).parent


def test_sharded_cases_on_four_cpu_devices():
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                    " --xla_force_host_platform_device_count=4").strip(),
             JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         str(HERE / "sharded_cases.py")], env=env, cwd=HERE.parent,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert "4 passed" in proc.stdout, proc.stdout[-2000:]


def test_make_mesh_rejects_bad_sizes():
  with pytest.raises(TypeError, match="tp must be an int"):
    sharding.make_mesh(True)
  with pytest.raises(ValueError, match="tp=0 must be in"):
    sharding.make_mesh(0)
  with pytest.raises(ValueError, match="must be in \\[1, 1\\]"):
    sharding.make_mesh(2, devices=sharding.make_mesh(1).devices.flat)


def test_cli_tp_beyond_the_devices_is_a_usage_error(capsys):
  import jax

  from models import cli
  n = len(jax.devices())
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--prompt", "hi", "--tp", str(n + 1)])
  assert e.value.code == 2 and f"tp={n + 1} must be in [1, {n}]" in capsys.readouterr().err
