"""moe_layer with ep_axis under shard_map, on 2 and 4 CPU devices of one process and on two
processes (jax.distributed, gloo), against moe_layer on one device. The cases are in
ep_layer_cases.py and ep_two_processes.py: each runs in fresh processes, as XLA_FLAGS must be set
before jax starts."""

import pathlib
import socket
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


def test_two_processes_with_jax_distributed_equal_the_one_device_layer():
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    runs = [subprocess.Popen([sys.executable, str(HERE / "ep_two_processes.py"), str(i),
                              str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for i in range(2)]
    try:
        outs = [r.communicate(timeout=600)[0] for r in runs]
    finally:
        for r in runs:
            r.kill()  # no process outlives the test, even when the other hangs
    for i, (r, out) in enumerate(zip(runs, outs)):
        assert r.returncode == 0, f"process {i}:\n{out}"
        assert f"ok process {i} of 2" in out, out
