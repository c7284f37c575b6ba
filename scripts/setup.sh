#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs parakit with its pinned dependencies.
# Source it (". scripts/setup.sh") to get the venv activated; re-running is cheap once done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PARAKIT_PYTHON:-python3}"
# The stamp changes whenever the pins or this script change, which triggers a re-install.
STAMP="$VENV/.parakit-setup-$(cat "$ROOT/constraints.txt" "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha1sum | cut -c1-12)"

if [[ ! -f "$STAMP" ]]; then
  echo "[parakit setup] creating $VENV (one-time; a few minutes)" >&2
  venv_args=()
  # A GPU machine usually ships its own CUDA torch: inherit it rather than replace it.
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[parakit setup] using the system's CUDA torch" >&2
    venv_args+=(--system-site-packages)
  fi
  [[ -d "$VENV" ]] || "$PY" -m venv "${venv_args[@]}" "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  CONSTRAINTS="$ROOT/constraints.txt"
  if [[ ${#venv_args[@]} -gt 0 ]]; then
    # Pin torch to the system's build so that no dependency pulls another one.
    CONSTRAINTS="$VENV/constraints.txt"
    torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
    sed "s/^torch==.*/torch==${torch_version}/" "$ROOT/constraints.txt" > "$CONSTRAINTS"
  fi
  "${PIP[@]}" install --upgrade "pip>=24" -c "$CONSTRAINTS" >&2
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install -c "$CONSTRAINTS" torch==2.13.0 >&2
  fi
  "${PIP[@]}" install -c "$CONSTRAINTS" numpy "packaging>=24.2" psutil >&2
  # megatron-core 0.19.2 declares Requires-Python>=3.12 but ships a working cp311 wheel;
  # install that wheel without the metadata check (see shared reference notes).
  if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('megatron-core')=='0.19.2'" 2>/dev/null; then
    dl="$(mktemp -d)"
    "${PIP[@]}" download megatron-core==0.19.2 --no-deps --ignore-requires-python -d "$dl" >&2
    "${PIP[@]}" install --no-deps --ignore-requires-python "$dl"/megatron_core-0.19.2-*.whl >&2
    rm -rf "$dl"
  fi
  "${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[dev]" >&2
  touch "$STAMP"
  echo "[parakit setup] done" >&2
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# DeepSpeed: pick the CPU accelerator where there is no GPU; cache compiled ops in the checkout.
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
