#!/usr/bin/env bash
# Records bench/jax_layer_ep.py (issue 21) under bench/results/ (see record_common.sh): the
# expert-parallel moe_layer on 1, 2 and 4 CPU devices of one process (all_to_all exchange), and
# on 2 and 4 processes under mpiexec (the MPI exchange beside the all_to_all one), each against
# one device; qwen3-30b-a3b, 4096 tokens in all, bf16, forward + backward. About 9 minutes on
# 2 cores.
# Usage: bench/record_jax_layer_ep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
op=jax_layer_ep
runner=(.venv/bin/python bench/jax_layer_ep.py)
runner_shown="python bench/jax_layer_ep.py"
source bench/record_common.sh
start_report "moekit.jax moe_layer with ep_axis on CPU devices (jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
run qwen3-bf16-4096 --preset qwen3-30b-a3b --tokens 4096 --devices 1,2,4 --processes 2,4 \
  --reps 3
echo "wrote $report" >&2
