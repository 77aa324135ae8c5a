"""What proves the kernels right, shared by the tests, `python -m gspo_kernels check`, the
benchmarks and the examples: the float64 reference (reference.py), random problems with known
clipping (problems.py), the comparison against the reference (verify.py), a problem cut the way
each parallel split holds it (problem_split.py), and a tiny offline model, tokenizer and trainer
(tiny.py)."""
