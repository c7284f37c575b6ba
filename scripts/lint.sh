#!/usr/bin/env bash
# Set up if needed, then lint: ruff's checks and its formatter, as configured in pyproject.toml.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
ruff check toolkit tests scripts hydra_plugins
ruff format --check toolkit tests scripts hydra_plugins
