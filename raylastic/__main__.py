"""``raylastic <command>`` (console script) and ``python -m raylastic <command>``.

Commands: ``report`` (see ``raylastic report --help`` and docs/report.md) and ``check``
(``raylastic check --help``, cluster-configs/README.md). Kept light: importing this module
imports neither Ray nor torch (nor does ``check``: it runs where no cluster is).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: raylastic <command> [options]

commands:
  report RUN_PATH   what elasticity did in a run and what it saved (--json, --plots DIR)
  check CONFIG...   whether Ray cluster configs give raylastic what it needs (offline)

'raylastic <command> --help' describes a command's options."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from raylastic import __version__

        print(f"raylastic {__version__}")
        return 0
    if args[0] == "report":
        from raylastic.reporting.cli import main as report_main

        return report_main(args[1:])
    if args[0] == "check":
        from raylastic.check import main as check_main

        return check_main(args[1:])
    print(f"raylastic: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
