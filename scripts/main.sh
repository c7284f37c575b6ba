#!/usr/bin/env bash
# The main job: set up if needed, then train the tiny model on the real corpus (the King James
# Bible, GPT-2 BPE) on 4 CPU ranks with tp=2 x pp=2 x vpp=2, interleaved 1F1B, distributed
# optimizer, for 40 steps (a few minutes). Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
parakit train recipe=tiny_cpu_demo "$@"
