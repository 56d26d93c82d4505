#!/usr/bin/env bash
# The checks that need a GPU, in one pass on a CUDA machine (a lent GPU, or yours), most
# wanted first, so a pass cut short still returns them:
#   1. the device-parametrised tests' cuda cases, benchmarks/torch_models.py on cuda (a torch module batched over
#      clients against a per-client loop), and with a broker the runtime's end-to-end tests on both devices
#      (workers computing on cuda over RabbitMQ, 8-bit payloads decoded onto the GPU);
#   2. with a broker, benchmarks/runtime_benchmark.py on the machine's cores (CPU workers; screened, the default,
#      and unscreened) and on cuda, for the 24-client config;
#   3. `dfca run` of the demo on cuda and on the CPU, and what the simulator's consensus metrics cost on cuda;
#   4. with a broker, the runtime benchmark's demo config on the CPU and on cuda, then both configs again on the CPU;
#   5. the simulator-round benchmark on cuda;
#   6. with time left, the scale curve and the paper's scale on cuda.
#
#     DFCA_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_checks.sh [OUT_DIR] [SECONDS]
#
# (DFCA_COMMIT: the commit the copy was made from, which the benchmarks' raw lines then name; a device machine's
# copy of the repository may carry stale git metadata.)
# OUT_DIR (default runs/gpu_checks) receives log.txt and each benchmark's raw figures; SECONDS (default 420) is
# the budget: each step gets its own timeout and is skipped when too little is left. Python packages the machine
# lacks can come as wheels in .whl/ (installed into /tmp/site, nothing else touched); the project itself is
# imported from the checkout (PYTHONPATH), not installed. A machine without RabbitMQ gets it from
# .rmq/rabbitmq.tar.xz (scripts/pack_device_bundle.sh makes both), unpacked into Debian's paths.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_checks}
budget=${2:-420}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
step() { echo; echo "=== $* (at $((SECONDS - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg))"; }
# `within N CMD...`: run CMD with a timeout of N seconds, or of what is left if less; skip it under 20 s left.
within() {
  local limit=$1; shift
  local rest; rest=$(left)
  if [ "$rest" -lt 20 ]; then echo "skipped: $rest s left"; return 0; fi
  timeout $((limit < rest ? limit : rest)) "$@"
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/shared:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step "machine"
nvidia-smi -L; nproc; git rev-parse --short HEAD 2>/dev/null || true
python3 -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())" || exit 1

step "broker"
export PATH="/usr/lib/rabbitmq/bin:/usr/lib/erlang/bin:$PATH"
if ! command -v rabbitmq-server >/dev/null && [ -f .rmq/rabbitmq.tar.xz ]; then
  tar -C / -xJf .rmq/rabbitmq.tar.xz && mkdir -p /var/lib/rabbitmq /var/log/rabbitmq
fi
broker=no
if command -v rabbitmq-server >/dev/null \
    && DFCA_RABBITMQ_PLUGINS=none within 150 bash scripts/start_rabbitmq.sh; then
  broker=yes
fi
echo "broker: $broker"

step "the device-parametrised tests' cuda cases"
within 200 python3 -m pytest -q -p no:cacheprovider -k cuda -rs \
  tests/test_devices.py tests/test_driver_equivalence.py tests/test_mlp_sample_space.py tests/test_kernel_floor.py \
  tests/test_core_aggregation.py tests/test_evaluation_metrics.py tests/test_torch_models.py
step "your own module batched over clients on cuda (the paper's CNN and the MLP as a module, against a per-client loop)"
within 150 python3 benchmarks/torch_models.py --device cuda --out "$out/torch_models_runs.jsonl"
if [ "$broker" = yes ]; then
  step "the runtime end to end over RabbitMQ, on the CPU and on cuda"
  within 200 env CI=true python3 -m pytest -q -p no:cacheprovider -rs tests/test_runtime_robust_rabbitmq.py
fi

bench() {  # bench DEVICE [ARGS...]: the runtime against the simulator, on this machine's cores or its GPU
  local device=$1; shift
  step "runtime benchmark ${*:-(24 clients)} on $device"
  within 150 python3 benchmarks/runtime_benchmark.py --skip-exchange --device "$device" "$@" \
    --out "$out/runtime_benchmark_runs.jsonl" | grep -v '^$'
}
if [ "$broker" = yes ]; then
  bench cpu
  bench cpu --screen off  # what the screen costs on the runtime, beside the screened run above
  bench cuda
fi

for device in cuda cpu; do
  step "dfca run (the demo) on $device"
  began=$SECONDS
  within 120 python3 -m dfca.cli run --out "/tmp/demo_$device" --force --set "device=$device" | tail -n 25
  echo "dfca run on $device: $((SECONDS - began)) s wall"
  python3 - "$device" <<'EOF'
import json, sys
from pathlib import Path
s = json.loads(Path(f"/tmp/demo_{sys.argv[1]}/summary.json").read_text())
print(sys.argv[1], {k: s[k] for k in ("device", "test_accuracy", "cluster_ari", "seconds_per_round", "wall_seconds") if k in s})
EOF
done

step "the consensus metrics' forms on cuda"
within 90 python3 benchmarks/consensus_metrics.py --device cuda --out "$out/consensus_metrics_runs.jsonl"

if [ "$broker" = yes ]; then
  bench cpu --demo
  bench cuda --demo
  # a second run of each on the machine's cores, so its ratios come as a pair
  bench cpu
  bench cpu --demo
fi

step "simulator round on cuda"
within 150 python3 benchmarks/simulator_round.py --device cuda --out "$out/simulator_round_runs.jsonl"

step "scale curve on cuda"
within 200 python3 benchmarks/scale_curve.py --device cuda --clients 100,1000,3000,10000 --timeout 120 \
  --out "$out/scale_curve"

remaining=$(left)
step "the paper's scale on cuda, $remaining s left"
if [ "$remaining" -gt 60 ]; then
  timeout "$remaining" python3 benchmarks/cluster_recovery.py --paper --settings 0 --seeds 1 --columns "robust GI" \
    --device cuda --out "$out/paper_scale"
fi
step "done"
