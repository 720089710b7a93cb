#!/usr/bin/env bash
# Installs what is missing, builds, and runs the CPU test suite (what CI runs).
# Extra arguments go to ctest, e.g. scripts/test.sh -R Attention
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -L cpu -j "$(nproc)" "$@"
