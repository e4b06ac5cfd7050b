#!/usr/bin/env bash
# The README's test command: install into .venv (CPU build of torch), then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
# torch==2.13.0 is the CPU build on this project's machines; on a GPU machine install your CUDA build first.
pip install --quiet torch==2.13.0 -e '.[dev,models]'
python -m pytest "$@"
