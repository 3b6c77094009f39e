"""The llama.cpp peer harness's JSON results (bench/peer/ggml_mul_mat_peer.cpp --json) as a table.

python3 bench/tools/peer_table.py llama_peer.json
"""

import json
import sys

with open(sys.argv[1]) as f:
    rows = json.load(f)
if rows:
    print(rows[0]["peer"], "on", rows[0]["device"])
print(f"{'op':<10} {'type':<5} {'shape':<14} {'m':>3} {'mode':<8} {'us':>9} {'TB/s':>6} {'rel_err':>9}")
for r in rows:
    print(
        f"{r['op']:<10} {r['type']:<5} {r['shape']:<14} {r['m']:>3} {r['mode']:<8} {r['us']:>9.2f} "
        f"{r['tbps']:>6.2f} {r['rel_err']:>9.2e}{'' if r['ok'] else ' FAIL'}"
    )
