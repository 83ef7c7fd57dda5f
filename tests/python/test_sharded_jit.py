"""moekit.jax under jit with the tokens sharded over a 2 x 2 CPU mesh: each case of
sharded_jit_cases.py in a fresh process with 4 CPU devices (XLA_FLAGS is read once, when JAX
starts). The cases compare values and gradients with the one-device function and read the
compiled program for all-gathers."""

import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
# The case names, read from the file (importing it would start JAX with 4 devices here).
CASES = re.findall(r"^def case_(\w+)\(", (HERE / "sharded_jit_cases.py").read_text(), re.M)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_jit(case):
    run = subprocess.run([sys.executable, str(HERE / "sharded_jit_cases.py"), case],
                         capture_output=True, text=True, timeout=600, cwd=HERE)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
