#!/usr/bin/env bash
# The first run on an NVIDIA GPU (scripts/gpu_check.py says what it measures), or its dry run here.
#
#   bash scripts/build_gpu_wheels.sh                 # here: the wheels the GPU machine lacks, into .whl/
#   bash scripts/gpu_check.sh                        # there: install them, then every step; results in $OUT
#   bash scripts/gpu_check.sh --cpu                  # here: the same steps at toy size on CPU, with .venv
#   bash scripts/gpu_check.sh --only environment,probe,deepspeed_zero1   # some steps (all: 960 s + the megatron budget)
#   bash scripts/gpu_check.sh --budget 540           # the steps, in order, whose limits fit in 540 s; the rest skipped
#
# It probes the GPU first (`parakit probe`: OUT/probe/cluster/probed.yaml) and prints every training
# run's step time and memory beside the planner's on the datasheet cluster and on the probed one.
#
# The GPU machine has Python 3.12, a CUDA torch and transformers, no network, and none of
# megatron-core, DeepSpeed or Hydra: they come from .whl/, installed beside the system's packages
# into a folder of their own (nothing of the machine's own is replaced).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ " $* " == *" --cpu "* ]]; then
  source scripts/setup.sh
  exec python scripts/gpu_check.py "$@"
fi
PY="${PARAKIT_PYTHON:-python3}"
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu_check: no wheels in .whl/: run scripts/build_gpu_wheels.sh where pip works, and carry .whl" >&2
  exit 2
fi
SITE="${PARAKIT_GPU_SITE:-/tmp/parakit-site}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# DeepSpeed JIT-builds its ops on first use; keep the builds out of the working tree.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/parakit-torch-extensions}"
exec "$PY" scripts/gpu_check.py "$@"
