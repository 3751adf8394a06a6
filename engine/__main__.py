"""`python -m engine generate ...` runs one job here; `python -m engine serve ...` starts the engine service."""

import argparse
import sys

from engine.generate_cli import add_generate_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="H3Forge engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub)
    try:
        from engine.server.cli import add_serve_args
    except ImportError:
        pass
    else:
        add_serve_args(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
