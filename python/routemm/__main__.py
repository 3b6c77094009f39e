"""`python -m routemm <command>`: demo (the main job), backends, knobs."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(argv)
    if command == "backends":
        import routemm

        for name, available, reason in routemm.backend_status():
            print(f"{name:6} {'available' if available else 'unavailable: ' + reason}")
        return 0
    if command == "knobs":
        from . import env

        print(env.table_markdown())
        return 0
    print(f"usage: python -m routemm [demo|backends|knobs] ...  (unknown command {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
