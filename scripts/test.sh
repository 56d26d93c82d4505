#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need on a fresh Debian/Ubuntu
# machine -- torch 2.13.0 first (the CPU build where no NVIDIA GPU is present), then the project, RabbitMQ,
# docker-compose, and Chromium with its driver for the dashboard's browser test -- and runs ruff and pytest.
# Runs as root or as a user with sudo (for apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
py=python3
CPU_INDEX=https://download.pytorch.org/whl/cpu
install_torch() {  # $1: the python; never the CUDA build (gigabytes) on a machine without an NVIDIA GPU
  if "$1" -c "import torch" 2>/dev/null; then
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$1" -m pip install -q torch==2.13.0
  else
    "$1" -m pip install -q --timeout 20 --retries 1 torch==2.13.0 --index-url "$CPU_INDEX" \
      || "$1" -m pip install -q torch==2.13.0 --index-url "$CPU_INDEX"
  fi
}
as_root() {  # apt-get and the like: directly as root, else through sudo
  if [ "$(id -u)" = 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "scripts/test.sh: '$*' needs root: run as root or install sudo (missing packages: ${missing[*]})" >&2
    exit 1
  fi
}
if [ -z "${VIRTUAL_ENV:-}" ] && python3 -c 'import pathlib, sys, sysconfig
sys.exit(0 if (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists() else 1)'; then
  # Debian/Ubuntu's own Python refuses pip installs (PEP 668): use scripts/demo.sh's virtual environment
  venv=${DFCA_VENV:-.venv}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  py="$venv/bin/python"
  export PATH="$PWD/$venv/bin:$PATH"
fi
install_torch "$py"
# the project; torch is installed already, and the CPU index serves any torch pip would still ask for
if command -v nvidia-smi >/dev/null 2>&1; then
  "$py" -m pip install -q -e ".[test]"
else
  "$py" -m pip install -q -e ".[test]" --extra-index-url "$CPU_INDEX"
fi
bash scripts/install_rabbitmq.sh
bash scripts/start_rabbitmq.sh
missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)            # the dashboard's browser test
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  as_root timeout 900 apt-get update -q >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
"$py" -m ruff check shared services tests benchmarks scripts examples
# --durations: the slowest tests are named in every log (a test that hangs fails at pyproject's per-test timeout)
"$py" -m pytest -q -p no:cacheprovider --durations=15 "$@"
