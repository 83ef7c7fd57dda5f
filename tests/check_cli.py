"""`moekit` with bad arguments: each is refused before any work, with exit status != 0 and a
message that names the flag (or the unknown command) and the value given, and never a crash.
Usage: python check_cli.py path/to/moekit"""

import subprocess
import sys

CASES = [
    # (arguments, a part of the message)
    (["foo"], "moekit: unknown command 'foo'; known: bench"),
    (["bench", "foo"], "moekit bench: unknown command 'foo'; known: ragged_dot, router"),
    (["bench", "layer", "--tokens", "0"],
     "--tokens: must be a whole number of tokens in [1, 2^31 - 1], got '0'"),
    (["bench", "ragged_dot", "--tokens", "4,-3"], "--tokens: must be a whole number of tokens"),
    (["bench", "router", "--tokens", "3000000000"], "--tokens: must be a whole number of tokens"),
    (["bench", "permute", "--tokens", "12x"], "got '12x'"),
    (["bench", "layer", "--mem-limit-gib", "0"],
     "--mem-limit-gib: must be a positive number of GiB, got '0'"),
    (["bench", "ragged_dot", "--mem-limit-gib", "nan"],
     "--mem-limit-gib: must be a positive number"),
    (["bench", "dispatch", "--mem-limit-gib", "-1"], "--mem-limit-gib: must be a positive number"),
    (["bench", "ragged_dot", "--cache-mib", "0"],
     "--cache-mib: must be a whole number of MiB in [1, 2^30], got '0'"),
    (["bench", "layer", "--cache-mib", "32M"], "--cache-mib: must be a whole number of MiB"),
    (["bench", "ragged_dot", "--shard", "-1"],
     "--shard: must be a shard index in [0, --ep-shards), got '-1'"),
    (["bench", "ragged_dot", "--ep-shards", "0"], "--ep-shards: must be a count of shards"),
    (["bench", "ragged_dot", "--ep-shards", "4", "--shard", "4"], "--shard"),
    (["bench", "router", "--warmup", "-2"],
     "--warmup: must be a count of runs in [0, 10^6], got '-2'"),
    (["bench", "permute", "--reps", "0"], "--reps: must be a count of runs in [1, 10^6], got '0'"),
    (["bench", "layer", "--preset", "gpt-5"], "--preset"),
    # --device: cpu or cuda, for every bench that has it; what CUDA does not take is named.
    (["bench", "ragged_dot", "--device", "tpu"], "--device: tpu not in {cpu,cuda}"),
    (["bench", "router", "--device", "gpu"], "--device: gpu not in {cpu,cuda}"),
    (["bench", "permute", "--device", ""], "--device"),
    (["bench", "layer", "--device", "cuda0"], "--device: cuda0 not in {cpu,cuda}"),
    (["bench", "layer", "--device", "cuda", "--invariant", "--tokens", "4"],
     "--invariant: the batch-invariant mode runs on the CPU only"),
    (["bench", "layer", "--device", "cuda", "--ep", "2", "--tokens", "4"],
     "--ep: the layer over ranks runs on CPUs"),
    (["bench", "ragged_dot", "--device", "cuda", "--invariant", "--tokens", "4"],
     "--invariant: the batch-invariant mode runs on the CPU only"),
    # The floor's options (issue 35): the cache mode, the passes, the implementations.
    (["bench", "ragged_dot", "--cache", "hot"], "--cache: hot not in {cold,warm}"),
    (["bench", "layer", "--cache", "lukewarm"], "--cache: lukewarm not in {cold,warm}"),
    (["bench", "ragged_dot", "--passes", "fwd,bwd"], "--passes: bwd not in"),
    (["bench", "ragged_dot", "--impl", "cutlass"], "--impl: cutlass not in"),
    (["bench", "ragged_dot", "--matmul", "gate"], "--matmul: gate not in {ffn,up,down}"),
    (["bench", "ragged_dot", "--baseline", "fastest"], "--baseline: fastest not in"),
    # Over the memory limit: refused before the buffer is allocated.
    (["bench", "router", "--tokens", "4096", "--mem-limit-gib", "0.001", "--reps", "1"],
     "would pass --mem-limit-gib 0.001"),
    (["bench", "permute", "--tokens", "4096", "--mem-limit-gib", "0.001", "--reps", "1"],
     "would pass --mem-limit-gib 0.001"),
    (["bench", "ragged_dot", "--tokens", "4096", "--mem-limit-gib", "0.0001", "--reps", "1"],
     "over --mem-limit-gib 0.0001"),
    (["bench", "dispatch", "--engine", "threads", "--ranks", "2", "--tokens", "4096",
      "--mem-limit-gib", "0.001", "--reps", "1"], "would pass --mem-limit-gib 0.001"),
]


def main():
    tool = sys.argv[1]
    failed = 0
    for args, want in CASES:
        run = subprocess.run([tool, *args], capture_output=True, text=True, timeout=300)
        out = run.stdout + run.stderr
        ok = run.returncode > 0 and want in out  # a signal (a crash) is negative
        print(f"{'ok' if ok else 'FAILED'}: moekit {' '.join(args)} -> {run.returncode}: "
              f"{out.strip().splitlines()[-1] if out.strip() else ''}")
        if not ok:
            failed += 1
            print(out)
    print(f"{failed} failed of {len(CASES)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
