"""Merge a newer results file into an older one (same op and device), for a run that re-measured only
some cases:

    python3 bench/merge_results.py bench/results/q4_0_matmul-h200.json NEW.json

A record of NEW replaces the old record of the same case (op, shape, m, weight dtype, route, impl and
how the route was chosen: the note's first clause, e.g. "forced" / "default policy"); every record
keeps the git revision and the command it was measured with, and the header lists the commands by
revision. The Markdown table beside the old file is rewritten.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import _markdown  # noqa: E402


def case_key(record: dict) -> tuple:
    choice = record.get("note", "").split(";")[0].strip()
    return tuple(record.get(k) for k in ("op", "shape", "m", "weight_dtype", "route", "impl")) + (choice,)


def main(old_path: str, new_path: str) -> None:
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    if old["device"] != new["device"]:
        raise SystemExit(f"different devices: {old['device']!r} vs {new['device']!r}")
    for doc in (old, new):
        for r in doc["records"]:
            r.setdefault("git_rev", doc["git_rev"].split()[0])
            # A single run's header command is its records' command. A file merged before records
            # carried theirs has only the last merged run's in its header: those records stay
            # without one (the device-run logs under bench/lab/records/logs name them).
            if "records by revision" not in doc["git_rev"]:
                r.setdefault("command", doc["command"])
    replaced = {case_key(r): r for r in new["records"]}
    records = [replaced.pop(case_key(r), r) for r in old["records"]] + list(replaced.values())
    counts: dict = {}
    for r in records:
        counts[r["git_rev"]] = counts.get(r["git_rev"], 0) + 1
    merged = dict(old, records=records, command=new["command"], ceilings=new["ceilings"])
    merged["git_rev"] = (
        new["git_rev"] + " (records by revision: " + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ")"
    )
    with open(old_path, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    with open(os.path.splitext(old_path)[0] + ".md", "w") as f:
        f.write(_markdown(merged))
    print(f"{len(new['records'])} records merged into {old_path}; by revision: {counts}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
