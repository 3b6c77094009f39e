"""`python -m routemm <command>`: the command line, which lives in routemm/cli/main.py."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
