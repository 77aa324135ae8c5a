"""What differs between the torch and Triton versions the package supports (README, "Supported
versions"), in one place. Each helper takes one path on every version where it can, and says
which versions need what.

- check_torch: torch older than 2.4 (no torch.library.custom_op) is refused when the package is
  imported, by name, where a --no-deps install or a checkout got past pip's requirement.
- custom_op: torch.library.custom_op infers an op's schema from its annotations. torch 2.4 reads
  them as written, so a module with `from __future__ import annotations` (strings) or the
  `X | None` form fails there ("Parameter logits has unsupported type torch.Tensor"); later
  releases resolve both. The annotations are resolved here, to typing's forms, on every version.
- triton_version_problem: the kernels pass tuples to their jit functions, which Triton takes
  since 3.2; Triton 3.0.0 (torch 2.4's) ran them without an error and gave wrong results (the
  gradient check, seen here). Older Triton is refused: the backend is not offered.
- triton_interpreter_problem: Triton's interpreter before 3.7 turns 1-element arrays into Python
  scalars, which numpy 2.4 made an error (an InterpreterError "only 0-dimensional arrays can be
  converted to Python scalars" from inside a kernel). Seen here: Triton 3.5.1 and 3.6.0 run with
  numpy 2.3 and fail with 2.4.0; 3.7.1 and 3.8.0 run with 2.4.6. The Triton backend refuses that
  pairing on CPU tensors up front, saying what to change.
- COMPILE_FUSED_LINEAR: torch.compile(fullgraph=True) over the fused-linear loss is tested from
  torch 2.11 (2.11 and 2.14 trace it whole). Older dynamo refuses parts of it: on 2.9.1 the
  one-pass schedule's autograd Function, whose forward hands the loss's metrics back through the
  job it was given ("Mutating a variable not in the current scope"; without fullgraph it runs
  with a graph break); on 2.4.1 the construction of a LinearConfig, and with the torch backend
  the one-pass schedule's mm with out= on tensors that require grad. 2.5 to 2.8 and 2.10 were
  not tried.
"""

from __future__ import annotations

import types
import typing

import torch


def _typing_form(annotation):
    """`X | None` as typing.Optional[X], builtin generics (tuple[...]) as typing's: the forms every
    supported torch's schema inference knows."""
    if isinstance(annotation, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return typing.Optional[_typing_form(rest[0])]
        return typing.Union[tuple(_typing_form(a) for a in args)]
    if annotation is type(None):  # get_type_hints' form of `-> None`
        return None
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return typing.Tuple[tuple(_typing_form(a) for a in typing.get_args(annotation))]
    if origin is list:
        return typing.List[tuple(_typing_form(a) for a in typing.get_args(annotation))]
    return annotation


def custom_op(name: str, *, mutates_args):
    """torch.library.custom_op(name, mutates_args=...) with the function's annotations resolved
    first (module docstring)."""
    def register(fn):
        fn.__annotations__ = {key: _typing_form(value) for key, value in typing.get_type_hints(fn).items()}
        return torch.library.custom_op(name, mutates_args=mutates_args)(fn)

    return register


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TRITON_LOWEST = (3, 2)


def triton_version_problem(triton_version: str) -> str | None:
    """Why the Triton kernels cannot run on this Triton at all, or None."""
    if _version(triton_version) < TRITON_LOWEST:
        return (f"Triton {triton_version} is older than 3.2, the first that takes the tuple arguments the kernels "
                "pass (3.0 ran them and gave wrong results): install triton>=3.2 (torch 2.6 and later bring it), "
                "or use backend='cuda', 'cpu' or 'torch'")
    return None


def triton_interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these versions, or None."""
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) fails on numpy {numpy_version} inside "
                "the kernels (numpy 2.4 made the array-to-scalar conversion it uses an error): install "
                "numpy<2.4, or Triton >= 3.7")
    return None


COMPILE_FUSED_LINEAR = _version(torch.__version__) >= (2, 11)


TORCH_LOWEST = (2, 4)


def check_torch(version: str = torch.__version__) -> None:
    """ImportError naming the supported range for a torch older than it (pip's requirement is
    bypassed by --no-deps installs and source checkouts; torch.library.custom_op, which the ops
    use, came in 2.4)."""
    if _version(version) < TORCH_LOWEST:
        raise ImportError(f"gspo_kernels needs torch 2.4 or later (README, 'Supported versions'); this is torch "
                          f"{version}: pip install 'torch>=2.4'")


check_torch()  # on import: the package imports this module first
