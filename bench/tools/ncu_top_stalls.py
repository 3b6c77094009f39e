"""Top stall locations of an Nsight Compute source-page CSV (`ncu ... --page source --print-source sass
--csv > FILE`): the SASS lines with the largest share of warp-stall samples.

    python3 bench/tools/ncu_top_stalls.py FILE [N]
"""

import csv
import sys


def main(path: str, top: int) -> None:
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Source" in r)
    header = rows[head]
    source = header.index("Source")
    samples = next(i for i, c in enumerate(header) if c.startswith("Warp Stall Sampling (All"))
    data = [r for r in rows[head + 1 :] if len(r) > samples and r[samples].replace(",", "").isdigit()]
    total = sum(int(r[samples].replace(",", "")) for r in data) or 1
    for r in sorted(data, key=lambda r: -int(r[samples].replace(",", "")))[:top]:
        print(f"{100 * int(r[samples].replace(',', '')) / total:5.1f}%  {r[0]:>6}  {r[source][:120]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
