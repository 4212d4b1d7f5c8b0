#!/usr/bin/env bash
# Creates ./.venv with vitpe and its test tools, from scratch on a fresh machine; a no-op when it is already good.
# torch is never installed alone: pip resolves it together with torchvision (a local CPU-only torch
# wheel would otherwise be picked, and PyPI's torchvision does not import with it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import vitpe, torchvision.ops, timm, pytest" 2>/dev/null; then
  exit 0
fi
echo "setting up .venv (torch + torchvision from PyPI, ~5 GB, a few minutes)..." >&2
rm -rf .venv
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c "import torch, torchvision.ops, timm, vitpe; print(f'vitpe ready: torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}')"
