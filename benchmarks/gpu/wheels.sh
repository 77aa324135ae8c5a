#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels that the GPU machine lacks for
# benchmarks/trainer_steps/parity.py and benchmarks/gpu/megatron_group_of_one.py: TRL's GRPOTrainer and verl 0.9.1's actor worker, and what
# they import beyond that machine's own packages (torch 2.11, transformers 5.17, accelerate,
# peft, pandas, pyarrow, xxhash, click, msgpack, protobuf, requests, anyio, h11, typer and
# more). Nothing can be downloaded there; check.sh installs
# .whl/*.whl with pip --target /tmp/site. Run here, in the repo root, then carry .whl:
#
#   bash benchmarks/gpu/wheels.sh            # 27 wheels, about 33 MiB (ray trimmed: 21.5 of it)
#
# The list came from importing each trainer's entry points in a fresh process whose sys.path
# held only the GPU machine's packages, adding whatever was missing until the imports passed,
# then running parity.py on the CPU the same way. Versions: this repo's venv, which
# pyproject.toml's [trl] and [verl] extras pinned. transformers is not carried: the GPU machine's
# 5.17 satisfies trl 1.16 (>= 4.56.2), and the CPU run with 5.17 in place passed (the extras pin
# >= 5.23, the release the tests ran on).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
DEST=.whl
mkdir -p "$DEST"

TRL=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
# verl's actor worker: verl itself, its config (hydra, omegaconf), tensordict, ray (imported by
# every worker module) with jsonschema, and the rollout server's imports (fastapi, uvicorn,
# pydantic, orjson) that the worker module pulls in; typing_extensions because pydantic 2.14
# needs >= 4.16.
VERL=(verl==0.9.1 ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
      rpds-py==2026.9.1 hydra-core==1.3.8 omegaconf==2.3.1 tensordict==0.15.3 pyvers==0.2.3 codetiming==1.4.0
      orjson==3.13.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
      typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2 typing-extensions==4.16.0)

# megatron_group_of_one.py: megatron-core (2.6 MiB; numpy, packaging and torch are there).
MEGATRON=(megatron-core==0.16.1)
# The fused-linear peers timed beside ours (bench --linear's liger and cce rows): pure Python on
# Triton, under 1 MiB together.
PEERS=(liger-kernel==0.8.5 cut-cross-entropy==25.1.1)

"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${TRL[@]}" "${VERL[@]}" "${MEGATRON[@]}" "${PEERS[@]}"
# hydra-core 1.3 needs antlr4 4.9.*, published as an sdist only: built here into a pure-Python wheel.
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
# The whole ray wheel (76 MiB) is over the 64 MiB that travels: its cluster executables, jars and
# dashboard client go (wheel_trim.py says why that is safe here).
"$PY" benchmarks/gpu/wheel_trim.py "$DEST"/ray-2.60.0-*.whl
ls -1 "$DEST"
du -ch "$DEST"/*.whl | tail -n 1
