#!/usr/bin/env bash
# The demo command (README): on a fresh Debian/Ubuntu machine with Python >= 3.11, make a virtual
# environment (.venv, or DFCA_VENV), install torch 2.13.0's CPU build and the project into it, and run
# the bundled demo with `dfca run`. Extra arguments go to `dfca run` (e.g. --rounds 5).
#
# torch comes from PyTorch's CPU wheel index: from PyPI the same pin is the CUDA build (about 530 MB plus
# the nvidia-* packages). DFCA_TORCH_INDEX picks another index (e.g. https://download.pytorch.org/whl/cu130
# for a GPU machine); where the index cannot be reached, torch==2.13.0 comes from the default index.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DFCA_VENV:-.venv}
index=${DFCA_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || {
    echo "python3 -m venv failed: on Debian/Ubuntu, apt-get install python3-venv" >&2; exit 1; }
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "installing torch==2.13.0 from $index into $venv" >&2
  "$py" -m pip install -q --timeout 20 --retries 1 "torch==2.13.0" --index-url "$index" || {
    echo "$index could not be reached: installing torch==2.13.0 from the default index" >&2
    "$py" -m pip install -q "torch==2.13.0"; }
fi
echo "installing dfca into $venv" >&2
"$py" -m pip install -q -e .
"$venv/bin/dfca" run --out runs/demo --force "$@"
echo "next: . $venv/bin/activate, then dfca --help (docs: README.md)" >&2
