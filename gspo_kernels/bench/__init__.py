"""The benchmark suite behind `python -m gspo_kernels bench` and `pytest benchmarks/cpu`.

problem.py builds inputs, providers.py names every implementation that is timed, timing.py
and memory.py measure one of them (probe.py is memory's child process), runner.py runs the
grid, report.py prints and plots it with table.py's plain-text tables. linear.py is the
fused-linear grid, distributed.py the splits over gloo processes, host.py the op count and
host time of a tiny call; ports.py picks a free port for a process group's rendezvous.
"""
