"""Checks the JSON that `moekit bench OP ... --json` prints on stdin.

Usage: check_bench_json.py OP COUNT
"""
import json
import sys

REQUIRED = {"op", "pass", "dtype", "preset", "tokens", "shards", "ms", "tflops"}


def main() -> int:
    op, count = sys.argv[1], int(sys.argv[2])
    cases = json.load(sys.stdin)
    assert isinstance(cases, list), f"expected a JSON array, got {type(cases).__name__}"
    assert len(cases) == count, f"expected {count} cases, got {len(cases)}"
    for c in cases:
        missing = REQUIRED - c.keys()
        assert not missing, f"case {c} lacks {sorted(missing)}"
        assert c["op"] == op, c
        assert c["pass"] in ("fwd", "dlhs", "drhs"), c
        assert c["ms"] > 0 and c["tflops"] > 0, c
    shards = sorted({c["shards"] for c in cases})
    print(f"ok: {len(cases)} {op} cases, shards {shards}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
