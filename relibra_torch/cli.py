"""The ``relibra`` command line.

Each subcommand lives next to the code it drives and registers itself through a
``(name, add_arguments, run)`` triple in ``_SUBCOMMANDS``; modules are imported lazily so
that ``relibra inspect`` does not pay for importing the simulator.

Exit codes: 0 success, 2 bad input (a one-line error naming the option or field), 1 for
anything unexpected. When the reader of stdout closes it early (``relibra inspect FILE |
head``) the command stops quietly with exit code 1 (what rich's console does in the same
case, and what the Python documentation advises), without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> module that defines `add_arguments(parser)` and `run(args) -> int`
_SUBCOMMANDS = {
    "inspect": "relibra_torch.replay.cli",
    "convert": "relibra_torch.convert_cli",
    "simulate": "relibra_torch.sim.cli",
    "serve-sim": "relibra_torch.serving.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relibra",
        description="Balance MoE expert load in RL training with routing replay.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(
            name, help=module.HELP, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def _reader_closed_stdout() -> int:
    """stdout's reader went away (``| head``): send what is still buffered to /dev/null so
    that the interpreter's final flush does not raise again; exit code 1."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured)
        pass
    return 1


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            code = int(args._run(args) or 0)
        except (ValueError, TypeError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                PermissionError) as exc:
            # Bad input: one line, exit 2 (argparse uses 2 for usage errors too).
            if isinstance(exc, OSError) and exc.filename is not None and not str(exc).startswith(str(exc.filename)):
                exc = f"{exc.filename}: {exc.strerror.lower() if exc.strerror else exc}"
            print(f"relibra {args.command}: error: {exc}", file=sys.stderr)
            return 2
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _reader_closed_stdout()


if __name__ == "__main__":
    sys.exit(main())
