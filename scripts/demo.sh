#!/usr/bin/env bash
# The README's demo command: install into .venv (CPU build of torch), then train on the emulated cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet torch==2.13.0 -e .
hetero-ray demo "$@"
