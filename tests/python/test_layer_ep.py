"""moe_layer with ep_axis under shard_map, on 2 and 4 CPU devices of one process (XLA's all_to_all
and, emulated, its ragged_all_to_all), on two processes (jax.distributed, gloo) and, with
ep_exchange="mpi", on 2 and 3 processes under mpiexec, against moe_layer on one device. The
cases are in ep_layer_cases.py and ep_processes.py: each runs in fresh processes, as XLA_FLAGS
must be set before jax starts."""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from moekit.jax import ep, ep_mpi

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ep_problem import cases  # noqa: E402

CASES = len(cases(2))  # ep_problem's cases, each run in f32 and bf16


def test_block_rows():
    # Dropless: every row; with a capacity, E_loc experts of the aligned capacity, at most rows.
    assert ep.block_rows(8, 4, 2, 2, rows=16) == 16
    assert ep.block_rows(8, 4, 2, 2, rows=16, capacity_factor=1.0, align_size=3) == 2 * 6
    assert ep.block_rows(8, 4, 2, 2, rows=16, capacity_factor=1.0, pad_to_capacity=True) == 8
    # A capacity past every row (and past what a float holds once multiplied): every row.
    assert ep.block_rows(8, 4, 2, 2, rows=16, capacity_factor=1e308) == 16


@pytest.mark.parametrize("kw,match", [
    (dict(k=2.5), r"block_rows: k = 2.5: must be an integer"),
    (dict(num_ranks=3), r"block_rows: num_ranks = 3: must be in \[1, num_experts\] = \[1, 2\]"),
    (dict(rows=-1), r"block_rows: rows = -1: must be in \[0, "),
    (dict(capacity_factor=0.0), r"block_rows: capacity_factor = 0.0: must be finite and > 0"),
    (dict(capacity_factor=1.0, align_size=0), r"block_rows: align_size = 0"),
])
def test_block_rows_arguments_are_named(kw, match):
    args = {"tokens": 8, "num_experts": 2, "num_ranks": 2, "k": 1, "rows": 8, **kw}
    with pytest.raises((TypeError, ValueError), match=match):
        ep.block_rows(args.pop("tokens"), args.pop("num_experts"), args.pop("num_ranks"),
                      args.pop("k"), **args)


@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_layer_equals_the_one_device_layer(devices):
    run = subprocess.run([sys.executable, str(HERE / "ep_layer_cases.py"), str(devices)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    # Every case, f32 and bf16, with each of XLA's exchanges, each on every device; the two
    # cases on packed weights (frozen experts) likewise; and the three bad arguments.
    for exchange in ("all_to_all", "ragged"):
        where = f"on {devices} devices ({exchange})"
        assert sum(line.startswith("ok ") and not line.startswith("ok packed ") and where in line
                   for line in lines) == 2 * CASES, exchange
        assert sum(line.startswith("ok packed ") and where in line for line in lines) == 2 * 2
    assert sum(line.startswith("ok error: ") for line in lines) == 3
    assert lines[-1] == "0 failed"


def test_two_processes_with_jax_distributed_equal_the_one_device_layer():
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    runs = [subprocess.Popen([sys.executable, str(HERE / "ep_processes.py"), "all_to_all",
                              str(i), "2", str(port), "shared_expert_geglu", "capacity:bf16"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]
    try:
        outs = [r.communicate(timeout=600)[0] for r in runs]
    finally:
        for r in runs:
            r.kill()  # no process outlives the test, even when the other hangs
    for i, (r, out) in enumerate(zip(runs, outs)):
        assert r.returncode == 0, f"process {i}:\n{out}"
        assert f"ok process {i} of 2" in out, out
        assert "ok auto is all_to_all" in out, out


@pytest.mark.skipif(not ep_mpi.available() or not shutil.which("mpiexec"),
                    reason="moekit built without MPI (libmoekit_jax_mpi.so), or no mpiexec")
@pytest.mark.parametrize("processes", [2, 3])
def test_mpi_exchange_under_mpiexec_equals_the_one_device_layer(processes):
    """ep_exchange="mpi", one process per device under mpiexec: every case, f32 and bf16, two of
    them on packed weights (frozen experts) too, and a mesh in the wrong order an error on every
    process."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.Popen(["mpiexec", "-n", str(processes), "--oversubscribe", sys.executable,
                            str(HERE / "ep_processes.py"), "mpi"], cwd=HERE, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out = run.communicate(timeout=600)[0]
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)  # mpiexec and every rank, even after a hang
        except ProcessLookupError:
            pass
    assert run.returncode == 0, out
    for i in range(processes):
        assert f"ok process {i} of {processes}" in out, out
    assert out.count("ok auto is mpi") == processes, out
    assert out.count("ok error on a mesh in the wrong order") == processes, out
    assert out.count("(mpi): out") == processes * (2 * CASES + 2 * 2), out
    # Of them, the two cases on packed weights (frozen experts), f32 and bf16.
    assert out.count("ok packed ") == processes * 2 * 2, out
