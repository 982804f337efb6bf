#!/usr/bin/env bash
# picotron's one entry point. Every command sets itself up on first use (and again when requirements change).
#
#   ./run.sh [train flags]   train the tiny Llama on the embedded Shakespeare (no network, no GPU needed)
#   ./run.sh test [pytest flags]   the test suite (multi-rank tests run real gloo processes)
#   ./run.sh lessons         Jupyter on lessons/
#   ./run.sh figures         regenerate figures/ from real runs
#   ./run.sh setup           only install what is missing
#
# Set-up installs into the Python you run it with ($PYTHON, default python3). torch is installed only
# when none is importable, so a GPU pod's CUDA build is reused. On several GPUs, train with torchrun:
#   torchrun --nproc_per_node 8 -m picotron.train --dp 8
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

setup() {
  local want
  want=$(cat requirements.txt pyproject.toml | cksum)
  if [ -f .setup-stamp ] && [ "$(cat .setup-stamp)" = "$want" ] && "$PY" -c "import torch, picotron" 2>/dev/null; then
    return
  fi
  echo "== set-up: installing what is missing into $("$PY" -c 'import sys; print(sys.prefix)')"
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
  fi
  "$PY" -m pip install --quiet -r requirements.txt
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
  echo "$want" > .setup-stamp
}

cmd=${1:-train}
case "$cmd" in
  setup)   setup ;;
  test)    shift; setup; exec "$PY" -m pytest -q "$@" ;;
  lessons) setup; exec "$PY" -m jupyter notebook --notebook-dir lessons ;;
  figures) setup; exec "$PY" figures/make.py ;;
  train)   [ $# -gt 0 ] && shift; setup; exec "$PY" -m picotron.train --out runs/main --steps 600 --eval-every 100 "$@" ;;
  -*)      setup; exec "$PY" -m picotron.train --out runs/main --steps 600 --eval-every 100 "$@" ;;
  *)       echo "usage: ./run.sh [train|test|lessons|figures|setup] [args]" >&2; exit 2 ;;
esac
