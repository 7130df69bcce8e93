#!/usr/bin/env bash
# Bench environment: the system packages (torch, transformers, ...) plus TRL, in bench/.venv.
# TRL is a comparison target, never a dependency of the scripts. Checks that installing it moved
# neither torch nor transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
before=$($PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)")
if [ ! -x bench/.venv/bin/python ]; then
  $PY -m venv --system-site-packages bench/.venv
  # $PY's own packages too when $PY is itself a venv (its site-packages are not "system" ones)
  site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$site" > "$(bench/.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/base-packages.pth"
fi
bench/.venv/bin/pip install -q "trl==1.16.0"
after=$(bench/.venv/bin/python -c "import torch, transformers; print(torch.__version__, transformers.__version__)")
if [ "$before" != "$after" ]; then
  echo "error: installing TRL changed torch/transformers ($before -> $after)" >&2
  exit 1
fi
bench/.venv/bin/python -c "import trl; print('bench env ready: trl', trl.__version__, '| torch transformers', '$after')"
