"""Reruns one fuzz case from its printed repr: the one-line repro a failing fuzz test prints.

    TRITON_INTERPRET=1 .venv/bin/python tests/fuzz/replay.py "FuzzCase(entry='gspo_loss', ...)"
    TRITON_INTERPRET=1 .venv/bin/python tests/fuzz/replay.py "FuzzCase(...)" invalid=float_mask:2

Prints each broken rule (or "passed") and exits 1 on a failure, so it also checks a fix. With
`invalid=<corruption>:<variant>` it replays test_invalid_input_raises_a_clear_error's call
instead. It imports the gspo_kernels of the checkout it sits in.
"""

import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before gspo_kernels defines its Triton kernels
HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's package (not whichever one an editable install points at), then the fuzz's modules.
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from fuzz_build import build  # noqa: E402
from fuzz_case import FuzzCase  # noqa: E402
from fuzz_invalid import invalid_call  # noqa: E402
from fuzz_run import check_built  # noqa: E402


def _replay_invalid(case: FuzzCase, spec: str) -> int:
    corruption, variant = spec.split(":")
    thunk, expected = invalid_call(build(case), corruption, int(variant))
    try:
        thunk()
    except expected as exc:
        print(f"passed: {type(exc).__name__}: {exc}")
        return 0
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print(f"raised the wrong kind of error (wanted {getattr(expected, '__name__', expected)})")
        return 1
    print("no error raised")
    return 1


def main(argv) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    case = eval(argv[1], {"FuzzCase": FuzzCase})  # the repr a failing test printed
    if len(argv) == 3:
        return _replay_invalid(case, argv[2].removeprefix("invalid="))
    built = build(case)
    if built.near_tie:
        print(f"note: the fuzz skips this case (near a tie): {built.near_tie}")
    failures = check_built(built)
    for line in failures:
        print(line)
    print("passed" if not failures else f"{len(failures)} rule(s) broken")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
