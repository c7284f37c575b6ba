#!/usr/bin/env bash
# Set up if needed, then run the test suite. Extra arguments go to pytest
# (e.g. `-m slow` for the multi-process tests alone, `-m "not slow"` for the quick ones).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
python -m pytest -q "$@"
