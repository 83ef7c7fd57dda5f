"""moe_layer with ep_axis under shard_map, on 2 and 4 CPU devices, against moe_layer on one
device (the cases are in ep_layer_cases.py; each device count needs a fresh process, as
XLA_FLAGS must be set before jax starts)."""

import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_layer_equals_the_one_device_layer(devices):
    run = subprocess.run([sys.executable, str(HERE / "ep_layer_cases.py"), str(devices)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    # Five cases, f32 and bf16, each on every device; and the two bad shardings.
    assert sum(line.startswith("ok ") and f"on {devices} devices" in line for line in lines) == 10
    assert sum(line.startswith("ok error: ") for line in lines) == 2
    assert lines[-1] == "0 failed"
