"""The benchmark suite behind `python -m gspo_kernels bench` and `pytest benchmarks/cpu`.

problem.py builds inputs, providers.py names every implementation that is timed,
timing.py and memory.py measure one of them, runner.py runs the grid, report.py prints and
plots it.
"""
