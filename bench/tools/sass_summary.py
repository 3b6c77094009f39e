"""Summaries of `cuobjdump -sass` output, one line per kernel function.

    python3 bench/tools/sass_summary.py SASS_FILE loads               # expert-ID kernels: loads, FMAs, spills
    python3 bench/tools/sass_summary.py SASS_FILE mix q4_ [OUT_FILE]  # instruction mix of functions matching q4_

`loads` counts the load, FMA, local-memory and shuffle instructions of every function whose name
holds "dense" or "kernel" (vector widths, L2-evict hints and spills at a glance); `mix` lists the 30
commonest opcodes of every function whose name holds the given text.
"""

import collections
import re
import sys

LOAD_OPCODES = ["LDG.E.128", "LDG.E.ENL2.128", "LDG", "LDS.128", "LDS", "FFMA", "LDL", "STL", "SHFL"]
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def functions(text: str):
    """(name, body) of every function in the listing."""
    for chunk in re.split(r"\n\s*Function : ", text)[1:]:
        name, _, body = chunk.partition("\n")
        yield name, body


def load_counts(text: str) -> list[str]:
    lines = []
    for name, body in functions(text):
        if "dense" not in name and "kernel" not in name:
            continue
        short = re.sub(r"_ZN7routemm4cuda\w+?_GLOBAL__N__\w+?(\d+)(direct|grouped|map)", r"\2", name)[:60]
        counts = {op: len(re.findall(re.escape(op), body)) for op in LOAD_OPCODES}
        lines.append(f"SASS {short} {counts}")
    return lines


def instruction_mix(text: str, match: str) -> list[str]:
    lines = []
    for name, body in functions(text):
        if match not in name:
            continue
        ops = [m.group(1) for m in INSTRUCTION.finditer(body)]
        count = collections.Counter(op.split(".")[0] for op in ops)
        lines.append(f"{name[:160]}\n  {len(ops)} instructions: {count.most_common(30)}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("loads", "mix") or (argv[1] == "mix" and len(argv) < 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        text = f.read()
    lines = load_counts(text) if argv[1] == "loads" else instruction_mix(text, argv[2])
    report = "\n".join(lines) + "\n"
    if argv[1] == "mix" and len(argv) > 3:
        with open(argv[3], "w") as f:
            f.write(report)
    else:
        sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
