#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12, a CUDA torch and transformers but none of
# megatron-core, DeepSpeed, Hydra and their small dependencies (and no network): built or fetched
# here into .whl/ (ignored by git), at the versions this checkout's .venv runs, for
# scripts/gpu_check.sh to install there with `pip install --no-index --no-deps --target`.
#
#   bash scripts/build_gpu_wheels.sh          # -> .whl/*.whl, 64 MiB at most in all
#
# DeepSpeed is an sdist: it builds here into a pure-python wheel with no ops prebuilt (they are
# JIT-compiled where they are used; parakit's GPU runs need none of them). antlr4's 4.9.3 is an sdist
# too. megatron-core, pydantic-core and xxhash are binary: their cp312 manylinux wheels are downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh >/dev/null
OUT=.whl
LIMIT_MIB=64
rm -rf "$OUT" && mkdir -p "$OUT"
version() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

# Binary wheels for CPython 3.12 on x86-64 Linux (the GPU machine's), whatever this machine runs.
BINARY=(megatron-core pydantic-core xxhash)
# Pure-python wheels (py3-none-any) on PyPI.
PURE=(hydra-core omegaconf hjson pydantic annotated-types typing-inspection typing-extensions)
# Source distributions only: built into wheels here.
SOURCE=(deepspeed antlr4-python3-runtime)
# pyproject.toml's optional extra "gpu" (Liger's kernels), pinned there: not installed here (Triton is GPU only).
mapfile -t GPU_EXTRA < <(python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu'], sep='\n')")

platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
  manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
pip=(python -m pip --disable-pip-version-check -q)
pins=()
for name in "${BINARY[@]}" "${PURE[@]}"; do pins+=("$name==$(version "$name")"); done
pins+=("${GPU_EXTRA[@]}")
echo "[gpu wheels] downloading ${pins[*]}" >&2
"${pip[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none "${platforms[@]}" --platform any -d "$OUT" "${pins[@]}"
for name in "${SOURCE[@]}"; do
  pin="$name==$(version "$name")"
  echo "[gpu wheels] building $pin" >&2
  # DeepSpeed's setup.py imports torch: build against this venv's (no ops are compiled: DS_BUILD_OPS=0).
  DS_BUILD_OPS=0 "${pip[@]}" wheel --no-deps --no-build-isolation --no-binary "$name" -w "$OUT" "$pin"
done

count=$(ls "$OUT"/*.whl | wc -l)
expected=$(( ${#BINARY[@]} + ${#PURE[@]} + ${#SOURCE[@]} + ${#GPU_EXTRA[@]} ))
if [[ "$count" -ne "$expected" ]]; then
  echo "[gpu wheels] expected $expected wheels, found $count in $OUT" >&2
  exit 1
fi
size_kib=$(du -sk "$OUT" | cut -f1)
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "[gpu wheels] $OUT holds $((size_kib / 1024)) MiB, over the ${LIMIT_MIB} MiB a GPU call may carry" >&2
  exit 1
fi
ls -1 "$OUT"
echo "[gpu wheels] $count wheels, $((size_kib / 1024)) MiB in $OUT" >&2
