"""Median gpu__time_duration per kernel name from `ncu --csv --metrics gpu__time_duration.sum` output.

ncu --clock-control none --csv --metrics gpu__time_duration.sum -c N ./lab > ncu.csv
python3 bench/tools/ncu_durations.py ncu.csv
"""

import csv
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    times = defaultdict(list)
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            unit = row["Metric Unit"]
            scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
            if unit not in scale:
                raise SystemExit(f"unknown duration unit {unit!r}")
            times[(row["Kernel Name"], row.get("Grid Size", ""), row.get("Block Size", ""))].append(
                float(row["Metric Value"].replace(",", "")) * scale[unit]
            )
    for (name, grid, block), t in times.items():
        print(
            f"{statistics.median(t):8.2f} us median, {min(t):8.2f} min, {len(t):4d} launches  {name[:90]} {grid} {block}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
