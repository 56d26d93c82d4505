#!/usr/bin/env bash
# The checks that need a GPU, in one pass on a CUDA machine (a development session's lent GPU, or yours):
# the device-parametrised tests' cuda cases, `dfca run` of the demo on cuda and on the CPU, the simulator-round
# benchmark on cuda, the scale curve on cuda, and (with time left) the paper's scale on cuda.
#
#     bash scripts/gpu_checks.sh [OUT_DIR] [SECONDS]
#
# OUT_DIR (default runs/gpu_checks) receives log.txt and each benchmark's raw figures; SECONDS (default 420) is
# the budget: each step gets its own timeout, and the paper-scale run gets what is left. Python packages the
# machine lacks can come as wheels in .whl/ (installed into /tmp/site, nothing else touched); the project itself
# is imported from the checkout (PYTHONPATH), not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_checks}
budget=${2:-420}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
step() { echo; echo "=== $* (at $((SECONDS - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg))"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/shared:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step "machine"
nvidia-smi -L; nproc; git rev-parse --short HEAD 2>/dev/null || true
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())" || exit 1

step "the device-parametrised tests' cuda cases"
timeout 180 python3 -m pytest -q -p no:cacheprovider -k cuda -rs \
  tests/test_devices.py tests/test_driver_equivalence.py tests/test_mlp_sample_space.py tests/test_kernel_floor.py

for device in cuda cpu; do
  step "dfca run (the demo) on $device"
  began=$SECONDS
  timeout 120 python3 -m dfca.cli run --out "/tmp/demo_$device" --force --set "device=$device" | tail -n 25
  echo "dfca run on $device: $((SECONDS - began)) s wall"
  python3 - "$device" <<'EOF'
import json, sys
from pathlib import Path
s = json.loads(Path(f"/tmp/demo_{sys.argv[1]}/summary.json").read_text())
print(sys.argv[1], {k: s[k] for k in ("device", "test_accuracy", "cluster_ari", "seconds_per_round", "wall_seconds") if k in s})
EOF
done

step "simulator round on cuda"
timeout 150 python3 benchmarks/simulator_round.py --device cuda --out "$out/simulator_round_runs.jsonl"

step "scale curve on cuda"
timeout 200 python3 benchmarks/scale_curve.py --device cuda --clients 100,1000,3000,10000 --timeout 120 \
  --out "$out/scale_curve"

remaining=$(left)
step "the paper's scale on cuda, $remaining s left"
if [ "$remaining" -gt 60 ]; then
  timeout "$remaining" python3 benchmarks/cluster_recovery.py --paper --settings 0 --seeds 1 --columns "robust GI" \
    --device cuda --out "$out/paper_scale"
fi
step "done"
