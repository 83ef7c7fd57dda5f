# Sourced by bench/record_*.sh: a Markdown report under bench/results/OP-cpu-DATE/ with the
# machine, the date and the commit, then each command with its table, and the JSON of every run
# beside it. Callers set `op` and `build`, call start_report TITLE, then run NAME ARGS... .
# A caller whose runs are not `moekit bench OP` sets the array `runner` (and `runner_shown`, the
# command as the report prints it) before sourcing this file.
day=$(date -u +%Y-%m-%d)
out=bench/results/$op-cpu-$day
# A second recording on the same day goes beside the first (-2, -3, ...), never over it.
n=1
while [[ -e $out ]]; do
  n=$((n + 1))
  out=bench/results/$op-cpu-$day-$n
done
report=$out/README.md
tool="$build/moekit"
if [[ -z ${runner+set} ]]; then
  runner=("$tool" bench "$op")
  runner_shown="moekit bench $op"
fi

isa() {  # the widest matmul ISA the CPU has, as oneDNN would pick it: AMX, AVX-512 (BF16), AVX2
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  if [[ $flags == *amx_bf16* ]]; then echo "AMX"
  elif [[ $flags == *avx512_bf16* ]]; then echo "AVX-512 with BF16"
  elif [[ $flags == *avx512f* ]]; then echo "AVX-512"
  elif [[ $flags == *avx2* ]]; then echo "AVX2"
  else echo "no AVX2"; fi
}

start_report() {  # start_report TITLE
  mkdir -p "$out"
  {
    echo "# $1, $day"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p') (family $(lscpu | sed -n 's/^CPU family: *//p')," \
         "model $(lscpu | sed -n 's/^Model: *//p'); $(isa)), $(nproc) cores," \
         "$(free -g | awk '/Mem:/{print $2}') GiB; oneDNN $(dpkg-query -W -f='${Version}' libdnnl-dev 2>/dev/null)," \
         "Highway $(dpkg-query -W -f='${Version}' libhwy-dev 2>/dev/null)."
    echo "Commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with local changes)')."
    echo
  } >"$report"
}

# Runs that go through mpiexec: Open MPI refuses to run as root unless told.
allow_mpi_as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
}

run() {  # run NAME ARGS...: one bench invocation, table into the report, JSON beside it
  local name=$1
  shift
  echo "== $name: $runner_shown $*" >&2
  {
    echo "## $name"
    echo
    echo '```'
    echo "\$ ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }$runner_shown $*"
    "${runner[@]}" "$@" --json 2> >(grep -v '^\[' >&3) >"$out/$name.json"
  } >>"$report" 3>&1
  sleep 1
  echo '```' >>"$report"
  echo >>"$report"
}
