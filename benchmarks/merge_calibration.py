"""Merge calibration runs into the envelope tables of server/detect/origin.py.

    python benchmarks/merge_calibration.py LOG [LOG ...]

Each LOG is the output of benchmarks/origin_calibration.py or
benchmarks/calibrate_dtype.py; every line that looks like ``  (key): (v0, v1, ...),``
is an envelope row.  Prints PARAM_ENVELOPE and FORWARD_ENVELOPE with, per key and
calibrated step, the largest value over the logs (made non-decreasing), ready to
paste.
"""

from __future__ import annotations

import ast
import re
import sys

_ROW = re.compile(r"^\s+(\(.*?\)): \((.*)\),$")


def merge(paths: list[str]) -> dict[tuple, list[float]]:
    rows: dict[tuple, list[float]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = _ROW.match(line)
                if not m:
                    continue
                key = ast.literal_eval(m[1])
                values = [float(v) for v in m[2].split(",")]
                old = rows.get(key, [0.0] * len(values))
                rows[key] = [max(a, b) for a, b in zip(old, values)]
    for key, values in rows.items():
        running = 0.0
        for i, v in enumerate(values):
            running = max(running, v)
            values[i] = running
    return rows


def main() -> int:
    rows = merge(sys.argv[1:])
    for name, size in (("PARAM_ENVELOPE", 3), ("FORWARD_ENVELOPE", 4)):
        print(f"{name} = {{")
        for key in sorted(k for k in rows if len(k) == size):
            print(f"    {key!r}: ({', '.join(f'{v:.1e}' for v in rows[key])}),".replace("'", '"'))
        print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
