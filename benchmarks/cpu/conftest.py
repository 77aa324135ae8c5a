import pytest
import torch

from gspo_kernels.bench.problem import DTYPES, Shape, make_bench_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small enough for a CPU run in about a minute; pass --bench-shape for the real sizes.
DEFAULT_SHAPE = "4x256x16384" if DEVICE == "cpu" else "16x1024x151936"


def pytest_addoption(parser):
    parser.addoption("--bench-shape", default=DEFAULT_SHAPE, help="BxTxV of the benchmark problem")
    parser.addoption("--bench-dtype", default="bf16", help="fp32 | bf16 | fp16")


@pytest.fixture(scope="session")
def bench_problem(request):
    shape = Shape.parse(request.config.getoption("--bench-shape"))
    return make_bench_problem(shape, DTYPES[request.config.getoption("--bench-dtype")], DEVICE)
