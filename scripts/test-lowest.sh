#!/usr/bin/env bash
# Runs the test suite on the lowest versions vitpe supports (constraints-lowest.txt, the floors of
# pyproject.toml) in ./.venv-lowest, so that those floors are tested, not hoped. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! [ -x .venv-lowest/bin/python ]; then
  echo "setting up .venv-lowest (the versions in constraints-lowest.txt, ~5 GB, a few minutes)..." >&2
  "$PY" -m venv .venv-lowest
  .venv-lowest/bin/python -m pip install -q --upgrade pip
fi
# Every run, so that a floor added since the environment was built is installed too (quick when nothing changed).
.venv-lowest/bin/python -m pip install -q -c constraints-lowest.txt -e '.[test]'
.venv-lowest/bin/python -c "import torch, torchvision, timm; print(f'lowest: torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}')"
exec .venv-lowest/bin/python -m pytest -q "$@"
