"""`python -m gspo_kernels check | bench`: the gradient check and the benchmark suite."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_kernels", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    from . import bench, check

    check.add_parser(commands)
    bench.add_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)
