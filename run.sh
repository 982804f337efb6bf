#!/usr/bin/env bash
# picotron's one entry point. Every command sets itself up on first use (and again when requirements change).
#
#   ./run.sh [train flags]   train the tiny Llama on the embedded Shakespeare (no network, no GPU needed)
#   ./run.sh test [pytest flags]   the default test suite (multi-rank tests run real gloo processes), ~12 min on 2 cores
#   ./run.sh test quick|lessons|heavy|load|all   a tier: quick (tests/quick.txt, ~3.5 min), lessons (the notebooks
#                            and checkers), heavy (more processes), load (timing checks on busy cores), all (the four);
#                            docs/tests.md
#   ./run.sh lessons         Jupyter on your copies of the lesson notebooks, runs/notebooks/ (lessons/ stays as
#                            committed); --fresh: make every copy again; --prepare-only: the copies, no Jupyter
#   ./run.sh figures         regenerate figures/ from real runs
#   ./run.sh gpu-check       the one-GPU check: every recipe and kernel for a few steps, one table (benchmarks/gpu_check.py)
#   ./run.sh setup           only install what is missing
#   ./run.sh python ...      the project's Python (e.g. ./run.sh python -m picotron.train --help)
#
# Where it installs: inside an active virtualenv or conda environment, into that one. Otherwise into a
# project-local environment, .venv/ here, made on first use (never into the system Python). If the base Python
# already has a torch (a GPU pod's CUDA build), .venv sees it through --system-site-packages and reuses it;
# torch==2.13.0 (CPU) is installed only when none is importable. $PYTHON picks the base Python (python3).
# Several processes: ./run.sh --dp 8 starts torchrun itself (one GPU each, or --device cpu). Several machines: the
# same command on each, with --nnodes N --rdzv-endpoint HOST:PORT [--node-rank R] --out DIR (DIR shared by all).
set -euo pipefail
cd "$(dirname "$0")"
BASE=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

die() { echo "run.sh: $*" >&2; exit 1; }

# The Python to use: an active environment's, else .venv's (made here on first use).
choose_python() {
  command -v "$BASE" >/dev/null || die "no '$BASE' on the PATH; install Python 3.10 or newer, or set PYTHON=/path/to/python3."
  if [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] || "$BASE" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    PY=$BASE  # already inside an environment the user chose
    return
  fi
  PY=$PWD/.venv/bin/python
  [ -x "$PY" ] && return
  local site=""
  if "$BASE" -c "import torch" 2>/dev/null; then
    site=--system-site-packages  # reuse the base Python's torch (e.g. a pod's CUDA build)
  fi
  echo "== set-up: making a project-local environment in .venv/ ${site:+(it sees the installed torch) }with $("$BASE" -c 'import sys; print(sys.executable)')"
  "$BASE" -m venv $site .venv 2>/dev/null || { rm -rf .venv; die "'$BASE -m venv' failed: install the venv module (e.g. apt-get install python3-venv) or activate an environment of your own, then run ./run.sh again."; }
}

setup() {
  local want
  want=$(cat requirements.txt pyproject.toml | cksum)
  # Set up already (the stamp names these requirements and this Python) and torch and picotron still findable?
  # find_spec locates them without importing torch: a second of every command, a minute on a busy machine.
  if [ -f .setup-stamp ] && [ "$(cat .setup-stamp)" = "$want $PY" ] && "$PY" -c \
      "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'picotron'))))" 2>/dev/null; then
    return
  fi
  echo "== set-up: installing what is missing into $("$PY" -c 'import sys; print(sys.prefix)')"
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -qq torch==2.13.0
  fi
  "$PY" -m pip install -qq -r requirements.txt
  "$PY" -m pip install -qq --no-build-isolation --no-deps -e .
  echo "$want $PY" > .setup-stamp
  echo "== set-up done; later runs skip it"
}

# ./run.sh test [quick|lessons|heavy|load|browser|all] [pytest flags]: one tier (tests/conftest.py's TIERS); none: the default.
run_tests() {
  case "${1:-}" in
    quick) shift; set -- --quick "$@" ;;
    default|lessons|heavy|load|browser|all) set -- "--tier=$1" "${@:2}" ;;  # one word: pytest would take lessons for a folder
  esac
  exec "$PY" -m pytest -q "$@"
}

# ./run.sh lessons [--fresh] [--prepare-only] [NN ...] [Jupyter flags]: Jupyter opens copies of the committed notebooks
# (lessons/_notebook.py --scratch makes them), so running a lesson never rewrites lessons/ (only ./run.sh figures does).
lessons() {
  local dir=${PICOTRON_NOTEBOOKS:-runs/notebooks} prepare_only="" a
  local mine=() jupyter=()
  for a in "$@"; do
    case "$a" in
      --prepare-only) prepare_only=1 ;;
      --fresh|[0-9][0-9]|[0-9][0-9]_*) mine+=("$a") ;;
      *) jupyter+=("$a") ;;
    esac
  done
  "$PY" lessons/_notebook.py --scratch --into "$dir" ${mine[@]+"${mine[@]}"}
  [ -n "$prepare_only" ] && return 0
  [ "$(id -u)" = 0 ] && jupyter+=(--allow-root)  # a rented GPU pod logs you in as root; Jupyter refuses it otherwise
  # the kernels' sockets encrypted where jupyter_client can (8.10+): ipykernel 7.4+ warns of plain TCP otherwise
  "$PY" -c 'import sys, zmq; from jupyter_client.manager import KernelManager as K
sys.exit(not (zmq.has("curve") and "transport_encryption" in K.class_trait_names()))' 2>/dev/null \
    && jupyter+=(--KernelManager.transport_encryption=required)
  exec "$PY" -m jupyter notebook --notebook-dir "$dir" ${jupyter[@]+"${jupyter[@]}"}
}

# The main job: 600 steps, evaluated and checkpointed every 100. Each run claims a folder of its own (runs/main,
# runs/main-2, ...; --out DIR to choose; --resume continues the run the flags name, with its own settings):
# picotron.runs, so that ./run.sh and python -m picotron.train behave the same. Those defaults travel apart from the
# user's flags (below every setting the user gives, --config's too), and the launcher's name with them, so the
# commands picotron hands back ("continue with ./run.sh --steps 1200 --resume --out runs/main") are what was typed.
train() {
  setup
  PICOTRON_LAUNCHER=./run.sh PICOTRON_LAUNCHER_DEFAULTS="--steps 600 --eval-every 100 --save-every 100" \
    exec "$PY" -m picotron.train "$@"
}

cmd=${1:-train}
choose_python
case "$cmd" in
  setup)   setup ;;
  test)    shift; setup; run_tests "$@" ;;
  lessons) shift; setup; lessons "$@" ;;
  figures) shift; setup; exec "$PY" figures/make.py "$@" ;;
  python)  shift; setup; exec "$PY" "$@" ;;
  gpu-check) shift; setup; exec "$PY" benchmarks/gpu_check.py "$@" ;;
  train)   [ $# -gt 0 ] && shift; train "$@" ;;
  -*)      train "$@" ;;
  *)       echo "usage: ./run.sh [train|test|lessons|figures|gpu-check|setup|python] [args]" >&2; exit 2 ;;
esac
