"""`python -m engine demo` (quick start), `generate` (one job in this process), `serve` (the engine service)."""

import argparse
import sys

from engine.demo_cli import add_demo_args
from engine.generate_cli import add_generate_args
from engine.server.cli import add_serve_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="H3Forge engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub)
    add_serve_args(sub)
    add_demo_args(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
