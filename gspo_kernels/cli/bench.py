"""Placeholder until the benchmark suite lands (issue: benchmark suite and command line)."""


def add_parser(commands) -> None:
    pass
