"""Checks the JSON that `moekit bench OP ... --json` prints on stdin.

Usage: bench/check_json.py OP COUNT [invariant] [floor] [subset] [packed]
(invariant: each case must carry the --invariant keys too; packed: each layer forward the
--packed-weights forward's time and its steps' (the two grouped matmuls among them); floor: each ragged_dot case, and each
layer forward, its floor on the CPU (and the layer's weight-reading steps each theirs): issue 35; subset: each layer case ran a subset of the
preset's experts at fewer tokens than it stands for, as --mem-limit-gib makes it; without it, the
tokens it stands for are its own)
"""
import json
import sys

# Keys every case of a bench carries, the passes it may report, its rate key, and the values
# its "op" key may take.
REQUIRED = {
    "ragged_dot": ({"op", "pass", "dtype", "preset", "tokens", "shards", "ms", "tflops", "ran"},
                   {"fwd", "dlhs", "drhs"}, "tflops", {"ragged_dot"}),
    "router": ({"op", "kernel", "pass", "preset", "tokens", "device", "ms", "gbps",
                "memcpy_gbps"},
               {"fwd", "bwd"}, "gbps", {"router"}),
    "permute": ({"op", "pass", "preset", "tokens", "device", "ms", "gbps", "memcpy_gbps"},
                {"fwd", "bwd"}, "gbps", {"permute", "unpermute"}),
    "layer": ({"op", "pass", "preset", "tokens", "device", "ms", "steps_ms", "tokens_per_s"},
              {"fwd", "bwd"}, "tokens_per_s", {"layer"}),
    # No passes; only the exchanges carry a rate (the plan has none), and dispatch and combine
    # their ratio to the plain all-to-all beside them.
    "dispatch": ({"op", "engine", "ranks", "tokens", "preset", "ms", "rows_received_max",
                  "rows_received_mean"},
                 None, "gbps", {"plan", "alltoallv", "dispatch", "alltoallv_back", "combine",
                                "alltoallv+regroup"}),
}


def main() -> int:
    op, count = sys.argv[1], int(sys.argv[2])
    flags = set(sys.argv[3:])
    assert flags <= {"invariant", "floor", "subset", "packed"}, f"unknown flags {sorted(flags)}"
    invariant, floor, subset = "invariant" in flags, "floor" in flags, "subset" in flags
    packed = "packed" in flags
    keys, passes, rate, ops = REQUIRED[op]
    cases = json.load(sys.stdin)
    assert isinstance(cases, list), f"expected a JSON array, got {type(cases).__name__}"
    assert len(cases) == count, f"expected {count} cases, got {len(cases)}"
    for c in cases:
        missing = keys - c.keys()
        assert not missing, f"case {c} lacks {sorted(missing)}"
        assert c["op"] in ops, c
        assert passes is None or c["pass"] in passes, c
        assert c["ms"] > 0, c
        if c["op"] != "plan":
            assert c[rate] > 0, c
        if op == "ragged_dot":  # the implementation that ran, by name (kAuto's choice)
            assert c["ran"] not in ("auto", "unknown"), c
        if op in ("router", "permute") and c["device"] == "cpu":  # the CPU also times a read
            assert c["read_gbps"] > 0, c
        if op == "layer" and ("experts" in c or subset):  # bench layer (not --ep): the experts
            assert c["experts"] > 0, c                      # run, the tokens the case stands for
            if subset:
                assert 1 <= c["tokens"] < c["stands_for_tokens"], c
            else:
                assert c["tokens"] == c["stands_for_tokens"], c
        if c["op"] in ("dispatch", "combine"):
            assert c["ratio_to_alltoallv"] > 0, c
        if invariant:  # --invariant: the batch-invariant mode's time and rate beside it
            assert c["invariant_ms"] > 0, c
            assert c.get("invariant_rate", c.get("fwd_bwd_invariant_rate", 0)) > 0, c
        if packed and c["pass"] == "fwd":  # --packed-weights: the forward on them, step by step
            assert c["packed_weights_ms"] > 0, c
            steps = c["packed_weights_steps_ms"]
            assert {"gmm_up", "gmm_down"} <= steps.keys(), c
            assert all(0 < v <= c["packed_weights_ms"] for v in steps.values()), c
        if floor and (op == "ragged_dot" or c["pass"] == "fwd"):  # the floor and the share of it
            for key in ("weight_bytes", "read_gbps", "dense_peak_tflops", "floor_ms",
                        "share_of_floor"):
                assert c[key] > 0, (key, c)
            assert c["bound"] in ("memory", "compute"), c
            if op == "layer":  # each weight-reading step against its own floor
                shares = c["steps_share_of_floor"]
                assert {"router_gemm", "gmm_up", "gmm_down"} <= shares.keys(), c
                assert all(v > 0 for v in shares.values()), c
                # the steps' weights are the forward's, split by step
                assert abs(sum(c["steps_weight_bytes"].values()) - c["weight_bytes"]) \
                    <= 1e-9 * c["weight_bytes"], c
    print(f"ok: {len(cases)} {op} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
