"""`python -m routemm <command>`: the command line.

Every command is an argparse subcommand with its own `--help`. A routemm.Error ends the command with
one line on stderr and exit status 1, never a traceback; a usage error (an argument argparse refuses,
or one the command refuses before it runs) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .. import _core
from ..core import env
from ..core._errors import Error
from . import demo, gguf_sample

_DESCRIPTION = (
    "routemm: native kernels for LLM inference (expert-ID matmul, GGML Q4_0 projections) with explicit, "
    "receipted routing."
)
_EPILOG = "Run `python -m routemm COMMAND --help` (or `python -m routemm help COMMAND`) for a command's options."


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line: `routemm demo: error: ... (... --help ...)`,
    exit status 2. Subcommand parsers are of this class too (add_subparsers takes the parent's)."""

    def error(self, message: str):
        name = self.prog.removeprefix("python -m ")
        self.exit(2, f"{name}: error: {' '.join(message.split())} ({self.prog} --help lists the options)\n")


def _backends(args, parser) -> int:
    for name, available, reason in _core.backend_status():
        status = "available" if available else "unavailable: " + reason
        if available and name == "cpu":
            cap = env.non_default().get("ROUTEMM_CPU_ISA")
            clone = demo.cpu_clone(_core.Device("cpu"))
            status += f" ({clone} kernels{f', capped by ROUTEMM_CPU_ISA={cap}' if cap else ''})"
        print(f"{name:6} {status}")
    return 0


def _knobs(args, parser) -> int:
    print(env.table_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m routemm", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"routemm {_core.version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def command(name: str, handler, summary: str, description: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=description or summary)
        sub.set_defaults(handler=handler, command_parser=sub)
        return sub

    demo.add_arguments(
        command(
            "demo",
            demo.main,
            "run a random MoE expert projection on the best backend, both routes, checked against float64",
            demo.__doc__.split("\n\n", 1)[1].strip(),
        )
    )
    gguf_sample.add_arguments(
        command(
            "gguf-sample",
            gguf_sample.main,
            "write a small MoE GGUF file (random weights) of a named architecture and expert type",
            gguf_sample.__doc__.split("\n\n", 1)[1].strip(),
        )
    )
    command("backends", _backends, "list the backends this build knows and why any is unavailable")
    command("knobs", _knobs, "print the environment knobs (name, type, default, effect) as a Markdown table")
    help_parser = command("help", None, "show this help, or a command's")
    help_parser.add_argument("topic", nargs="?", choices=sorted(commands.choices), help="the command to explain")

    def show_help(args, _parser) -> int:
        (commands.choices[args.topic] if args.topic else parser).print_help()
        return 0

    help_parser.set_defaults(handler=show_help)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's parser, which names the command
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args, args.command_parser)
    except Error as e:
        message = " ".join(str(e).split())  # one line, whatever the core's message holds
        print(f"routemm {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"routemm {args.command}: interrupted", file=sys.stderr)
        return 130
