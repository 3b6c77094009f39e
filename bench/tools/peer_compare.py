"""routemm's quantised expert-ID times beside llama.cpp's MUL_MAT_ID on the same card, one row per
(format, shape, projection, m): routemm's fastest timed route against the peer's rotated-buffer
time (both protocols keep the call's experts out of L2).

    python3 bench/tools/peer_compare.py QID_JSONL LLAMA_PEER_JSON --out DIR [--card h100]

QID_JSONL: `bash bench/device.sh qid`'s qid.jsonl (bench/tools/qid_timing.py's Q4_0 / Q8_0 records
and bench/tools/qid_format_timing.py's format records); LLAMA_PEER_JSON: its llama_peer.json
(bench/peer/ggml_mul_mat_peer.cpp --json). Writes DIR/qid_vs_llama-CARD.json and .md (results
format of DESIGN.md): per row routemm's time and route, the peer's, and speed = peer time /
routemm time (above 1: routemm ahead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import write_results  # noqa: E402

# The peer harness's shape names -> (routemm shape, projection).
PEER_SHAPES = {
    "qwen3_30b_a3b": ("qwen3-30b-a3b", "up"),
    "qwen3_30b_a3b_down": ("qwen3-30b-a3b", "down"),
    "qwen3.6_35b_a3b": ("qwen3.6-35b-a3b", "up"),
    "gpt_oss_20b": ("gpt-oss-20b", "up"),
}


def routemm_best(lines) -> dict:
    """(type, shape, proj, m) -> (time_us, route) of the fastest finite routemm record."""
    best: dict = {}
    for line in lines:
        d = json.loads(line)
        if "proj" in d:  # qid_format_timing
            key = (d["type"], d["shape"], d["proj"], d["m"])
        elif d.get("impl") == "routemm" and d.get("op") == "quantized_matmul_id":  # qid_timing (up)
            key = (d["weight_dtype"], d["shape"], "up", d["m"])
        else:
            continue
        t = d.get("time_us")
        if t is None or not math.isfinite(t):
            continue
        if key not in best or t < best[key][0]:
            best[key] = (t, d.get("route", "?"))
    return best


def compare(best: dict, peer: list) -> list:
    records = []
    for r in peer:
        if r.get("op") != "MUL_MAT_ID" or r.get("mode") != "rotated" or r["shape"] not in PEER_SHAPES:
            continue
        shape, proj = PEER_SHAPES[r["shape"]]
        key = (r["type"].lower(), shape, proj, r["m"])
        if key not in best:
            continue
        t, route = best[key]
        records.append(
            {
                "op": "quantized_matmul_id",
                "shape": f"{shape} {proj}",
                "m": r["m"],
                "weight_dtype": key[0],
                "route": route,
                "impl": "routemm",
                "time_us": t,
                "peer_us": r["us"],
                "speed_vs_peer": r["us"] / t,
                "note": f"{r['peer']}: {r['us']:.1f} us (rotated, rel err {r['rel_err']:.1e}); "
                f"speed {r['us'] / t:.2f}x",
            }
        )
    records.sort(key=lambda x: (x["weight_dtype"], x["shape"], x["m"]))
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("qid_jsonl")
    ap.add_argument("peer_json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--card", default=os.environ.get("CARD", "gpu"))
    args = ap.parse_args(argv)
    with open(args.qid_jsonl) as f:
        best = routemm_best(f)
    with open(args.peer_json) as f:
        peer = json.load(f)
    records = compare(best, peer)
    if not records:
        print("no (format, shape, m) in both files", file=sys.stderr)
        return 1
    device = peer[0].get("device", args.card)
    write_results(
        os.path.join(args.out, f"qid_vs_llama-{args.card}.json"),
        device=device,
        tool="bench/tools/peer_compare.py",
        records=records,
        peer=peer[0].get("peer", ""),
    )
    for r in records:
        print(
            f"{r['weight_dtype']:6} {r['shape']:22} {r['m']:>5} {r['time_us']:9.1f} {r['peer_us']:9.1f} "
            f"{r['speed_vs_peer']:5.2f}x {r['route']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
