"""The Q4_0 route-plan publication profile (spec §6.5) on this device, with real timings:

reachable M = 9, 16, 24, 32, 48, 64, 96, 128, 129, 2048, 4096 (required compatibility M = 2048, 4096) over
the "qwen dense" bases 17408x5120, 5120x17408 and 5120x5120 (N x K), first with one weight per base,
then with four distinct weights per base. For each: a cold calibration in a fresh registry, a
reactivation through the process cache in a second registry, validate_dense_q4_cartesian_acceptance
over the pair, then plan.save() and a reload (load_dense_q4_plan: current-weight proof, no timing)
in a third registry. Writes DESIGN-format results and both receipts.

    python3 bench/calibration_acceptance.py OUT_DIR 1 && python3 bench/calibration_acceptance.py OUT_DIR 4

Each weight count runs in its own process: the process cache is keyed without weights, so a second
profile in the same process would not be cold. The second call merges both into calibration-h200.json.
"""

import json
import os
import sys
import time

import numpy as np
import routemm
from routemm import q4_0

REACHABLE = (9, 16, 24, 32, 48, 64, 96, 128, 129, 2048, 4096)
REQUIRED = (2048, 4096)
BASES = ((17408, 5120), (5120, 17408), (5120, 5120))
TARGETS = {"cold": 3000.0, "reactivation": 300.0}

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
per_base_runs = (int(sys.argv[2]),) if len(sys.argv) > 2 else (1,)
os.makedirs(out_dir, exist_ok=True)
dev = routemm.Device()
rng = np.random.default_rng(0)
records = []


def weights_for(n, k, count):
    one = q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)).reshape(-1)
    out = []
    for i in range(count):  # distinct buffers: each a slightly different weight (scale bytes perturbed)
        w = one.copy()
        w[0] ^= i
        out.append(dev.from_numpy(w))
    return out


for per_base in per_base_runs:
    cases = []
    for n, k in BASES:
        for w in weights_for(n, k, per_base):
            cases.append(routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), REACHABLE))
    limits = routemm.DenseQ4CalibrationLimits(max_elapsed_ms=15000, max_shapes=256)
    # Each phase in a fresh registry, created outside the timed call.
    registries = [routemm.KernelRegistry(dev) for _ in range(3)]
    t0 = time.perf_counter()
    plan, cold = routemm.calibrate_dense_q4_routes(registries[0], dev, 1, limits, cases)
    cold_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    _, warm = routemm.calibrate_dense_q4_routes(registries[1], dev, 2, limits, cases)
    warm_ms = (time.perf_counter() - t0) * 1e3
    req = routemm.DenseQ4CartesianAcceptanceRequirements(len(BASES), per_base, REACHABLE, REQUIRED, 1, 15000.0)
    verdict = "passed"
    try:
        routemm.validate_dense_q4_cartesian_acceptance(cold, warm, req)
    except routemm.InvalidArgumentError as e:
        verdict = str(e)
    path = os.path.join(out_dir, f"q4_plan-{per_base}w.json")
    plan.save(path, cold)
    t0 = time.perf_counter()
    reloaded, _ = routemm.load_dense_q4_plan(path, registries[2], dev, cases)
    reload_ms = (time.perf_counter() - t0) * 1e3
    same = [d.route for d in reloaded.decisions] == [d.route for d in plan.decisions]
    for name, rec in (("cold", cold), ("reactivation", warm)):
        with open(os.path.join(out_dir, f"calibration-{per_base}w-{name}-receipt.json"), "w") as f:
            f.write(rec.to_json(indent=1))
    winners = sum(d.selected_route is routemm.DenseQ4Route.TENSOR_64X32 for d in cold.decisions)
    base = dict(
        op="calibration",
        shape="qwen-dense",
        weight_dtype="q4_0",
        route="plan",
        impl="routemm",
        m=len(REACHABLE),
        weights_per_base=per_base,
        acceptance=verdict,
        decisions=len(cold.decisions),
        candidate_wins=winners,
        timing_submissions=cold.timing_submissions,
        deadline_overrun_ms=cold.deadline_overrun_ms,
    )
    phases = (  # (phase, measured ms, target, what else the record says)
        ("cold", cold_ms, "cold", dict(receipt_elapsed_ms=cold.elapsed_ms)),
        ("reactivation (process cache)", warm_ms, "reactivation", dict(receipt_elapsed_ms=warm.elapsed_ms)),
        ("reload from plan file", reload_ms, "reactivation", dict(same_decisions=same)),
    )
    for phase, ms, target, extra in phases:
        records.append(
            dict(
                base,
                phase=phase,
                time_us=ms * 1e3,
                target_ms=TARGETS[target],
                target_met=ms <= TARGETS[target],
                **extra,
            )
        )
    print(
        f"{per_base} weight(s)/base: cold {cold_ms:.0f} ms, reactivation {warm_ms:.0f} ms, reload {reload_ms:.0f} ms, "
        f"acceptance {verdict}, 64x32 chosen {winners}/{len(cold.decisions)}, same decisions after reload {same}",
        flush=True,
    )
    for d in cold.decisions[: len(REACHABLE) * len(BASES) if per_base == 1 else 0]:
        times = {t.route.value: round(t.gpu.median_us, 1) for t in d.timings}
        print(
            f"  n={d.shape.n} k={d.shape.k} m={d.shape.m}: {d.selected_route.value} ({d.status.value}) gpu us {times}"
        )

previous = os.path.join(out_dir, "calibration-h200.json")
if os.path.exists(previous):  # merge the other weight counts' records
    with open(previous) as f:
        records = [r for r in json.load(f)["records"] if r["weights_per_base"] not in per_base_runs] + records
doc = {
    "device": dev.name,
    "git_rev": os.environ.get("GIT_REV", "unknown"),
    "command": "python3 bench/calibration_acceptance.py OUT_DIR 1; python3 bench/calibration_acceptance.py OUT_DIR 4",
    "ceilings": {"copy_TBps": 4.17, "bf16_TFLOPs": 794},
    "records": records,
}
with open(os.path.join(out_dir, "calibration-h200.json"), "w") as f:
    json.dump(doc, f, indent=1)
lines = [
    f"# {doc['device']} — {doc['git_rev']}",
    "",
    f"Command: `{doc['command']}`",
    "",
    "| phase | weights/base | decisions | 64x32 chosen | time (ms) | target (ms) | met | acceptance |",
    "|---|---|---|---|---|---|---|---|",
]
for r in records:
    lines.append(
        f"| {r['phase']} | {r['weights_per_base']} | {r['decisions']} | {r['candidate_wins']} | "
        f"{r['time_us'] / 1e3:.0f} | {r['target_ms']:.0f} | {r['target_met']} | {r['acceptance']} |"
    )
with open(os.path.join(out_dir, "calibration-h200.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
