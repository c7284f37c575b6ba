#!/usr/bin/env bash
# The main job: set up if needed, then generate the configs of the tiny CPU demo recipe
# (tp=2 x pp=2 x vpp=2 on 4 CPU ranks). Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
parakit generate recipe=tiny_cpu_demo "$@"
