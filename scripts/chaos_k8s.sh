#!/usr/bin/env bash
# Fault injection on Kubernetes: run an experiment over the REST API while pods are killed and a worker is
# cut off the network, check that it completed, and compare its test accuracy and cluster ARI with an unfaulted
# run of the same config. Exit status: 0 completed within tolerance; 1 failed or timed out; 3 completed but past
# the tolerance.
#
# Faults, every INTERVAL seconds, at most COUNT of them:
#   - a pod of a random target deleted: gracefully (SIGTERM, its grace period), or with --hard
#     (`--grace-period=0 --force`: SIGKILL, as a lost node). The controllers recreate it with the same name
#     and volumes, so it resumes from its checkpoints. `kubectl delete pod` bypasses the PodDisruptionBudgets.
#   - with --partition SECONDS, the first fault cuts one random worker off the network for SECONDS: the pod is
#     labelled dfca.dev/partitioned=true and the NetworkPolicy dfca-chaos-partition (deny all) applied; the
#     namespace's allow policies skip partitioned pods. Both are undone afterwards (and on exit).
#
# Usage: DFCA_API_TOKEN=... scripts/chaos_k8s.sh [options] CONFIG.json
#   CONFIG.json            an ExperimentConfig as JSON (the body of POST /experiments)
#   -n NAMESPACE           namespace of the deployment (default: dfca)
#   -i SECONDS             seconds between faults (default: 30)
#   -k COUNT               at most COUNT pod deletions (default: 5)
#   -p SECONDS             seconds between status polls (default: 5)
#   -t SECONDS             give up on a run after SECONDS (default: 3600)
#   --targets LIST         comma-separated pods to kill among worker,broker,topology,metrics,aggregator
#                          (default: worker)
#   --hard                 delete with --grace-period=0 --force (SIGKILL)
#   --partition SECONDS    also partition one worker for SECONDS
#   --baseline FILE        the unfaulted run's summary (JSON, GET /experiments/ID/summary); default: run the
#                          config once without faults first and use its summary
#   --no-baseline          report only, compare nothing
#   --accuracy-tolerance P allowed drop of test accuracy, in percentage points (default: 2)
#   --ari-tolerance X      allowed drop of cluster ARI (default: 0.1)
#   -l SELECTOR            label selector of the pods to kill (overrides --targets)
#   --api-url URL          topology API; default: a `kubectl port-forward` to svc/topology
#   --metrics-url URL      metrics API; default: a `kubectl port-forward` to svc/metrics
set -euo pipefail

NAMESPACE=dfca
INTERVAL=30
MAX_KILLS=5
POLL=5
TIMEOUT=3600
TARGETS=worker
SELECTOR=""
HARD=0
PARTITION=0
BASELINE=""
COMPARE=1
ACCURACY_TOLERANCE=2
ARI_TOLERANCE=0.1
API_URL=""
METRICS_URL=""
CONFIG=""

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }
log() { printf '[chaos %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    -n) NAMESPACE="$2"; shift 2 ;;
    -i) INTERVAL="$2"; shift 2 ;;
    -k) MAX_KILLS="$2"; shift 2 ;;
    -p) POLL="$2"; shift 2 ;;
    -t) TIMEOUT="$2"; shift 2 ;;
    -l) SELECTOR="$2"; shift 2 ;;
    --targets) TARGETS="$2"; shift 2 ;;
    --hard) HARD=1; shift ;;
    --partition) PARTITION="$2"; shift 2 ;;
    --baseline) BASELINE="$2"; shift 2 ;;
    --no-baseline) COMPARE=0; shift ;;
    --accuracy-tolerance) ACCURACY_TOLERANCE="$2"; shift 2 ;;
    --ari-tolerance) ARI_TOLERANCE="$2"; shift 2 ;;
    --api-url) API_URL="$2"; shift 2 ;;
    --metrics-url) METRICS_URL="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) log "unknown option $1"; usage ;;
    *) CONFIG="$1"; shift ;;
  esac
done
[ -n "$CONFIG" ] || usage
[ -r "$CONFIG" ] || die "cannot read $CONFIG"
[ -n "${DFCA_API_TOKEN:-}" ] || die "set DFCA_API_TOKEN (kubectl -n $NAMESPACE get secret dfca-secrets -o jsonpath='{.data.api-token}' | base64 -d)"
[ -z "$BASELINE" ] || [ -r "$BASELINE" ] || die "cannot read the baseline summary $BASELINE"
for tool in kubectl curl python3; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
SELECTORS=()
if [ -n "$SELECTOR" ]; then
  SELECTORS=("$SELECTOR")
else
  IFS=, read -r -a targets <<< "$TARGETS"
  for target in "${targets[@]}"; do
    case "$target" in
      worker|broker|topology|metrics|aggregator)
        SELECTORS+=("app.kubernetes.io/component=$target,app.kubernetes.io/part-of=dfca") ;;
      *) die "unknown target '$target' (worker, broker, topology, metrics, aggregator)" ;;
    esac
  done
fi
WORKER_SELECTOR="app.kubernetes.io/component=worker,app.kubernetes.io/part-of=dfca"

FORWARDS=()
PARTITIONED=""
heal() {
  [ -n "$PARTITIONED" ] || return 0
  log "healing the partition of $PARTITIONED"
  kubectl -n "$NAMESPACE" delete networkpolicy dfca-chaos-partition --ignore-not-found >/dev/null || true
  kubectl -n "$NAMESPACE" label "$PARTITIONED" dfca.dev/partitioned- >/dev/null 2>&1 || true
  PARTITIONED=""
}
cleanup() {
  heal
  for pid in "${FORWARDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

# Forward a local port to a Service; store its base URL in the variable named $3 once it answers.
port_forward() {
  local service="$1" port="$2" local_port
  local_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  kubectl -n "$NAMESPACE" port-forward "svc/$service" "$local_port:$port" >/dev/null 2>&1 &
  FORWARDS+=("$!")
  for _ in $(seq 1 50); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$local_port/livez" 2>/dev/null; then
      printf -v "$3" 'http://127.0.0.1:%s' "$local_port"
      return 0
    fi
    sleep 0.2
  done
  die "port-forward to svc/$service did not come up"
}

# GET/POST with the bearer token; prints the body, fails on HTTP errors.
api() {
  local method="$1" url="$2"
  shift 2
  curl -fsS -X "$method" -H "Authorization: Bearer $DFCA_API_TOKEN" "$@" "$url"
}

json_field() {
  python3 -c 'import json, sys; value = json.load(sys.stdin).get(sys.argv[1]); print("" if value is None else value)' "$1"
}

random_pod() {  # a random pod matching selector $1, as pod/NAME
  local pods=()
  mapfile -t pods < <(kubectl -n "$NAMESPACE" get pods -l "$1" -o name)
  [ "${#pods[@]}" -gt 0 ] || return 1
  printf '%s\n' "${pods[RANDOM % ${#pods[@]}]}"
}

delete_random_pod() {
  local selector pod
  selector="${SELECTORS[RANDOM % ${#SELECTORS[@]}]}"
  pod=$(random_pod "$selector") || { log "no pods match $selector"; return 1; }
  if [ "$HARD" = 1 ]; then
    log "killing $pod (--grace-period=0 --force)"
    kubectl -n "$NAMESPACE" delete "$pod" --grace-period=0 --force --wait=false >/dev/null 2>&1
  else
    log "deleting $pod"
    kubectl -n "$NAMESPACE" delete "$pod" --wait=false >/dev/null
  fi
}

partition_random_worker() {
  local pod
  pod=$(random_pod "$WORKER_SELECTOR") || { log "no worker pod to partition"; return 1; }
  log "partitioning $pod for ${PARTITION}s"
  kubectl -n "$NAMESPACE" label --overwrite "$pod" dfca.dev/partitioned=true >/dev/null
  PARTITIONED="$pod"
  kubectl -n "$NAMESPACE" apply -f - >/dev/null <<POLICY
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: dfca-chaos-partition
  labels:
    app.kubernetes.io/part-of: dfca
spec:
  podSelector:
    matchLabels:
      dfca.dev/partitioned: "true"
  policyTypes: ["Ingress", "Egress"]
POLICY
}

# Run CONFIG to its end; with faults when $1 is 1. Prints the experiment's summary.
run_experiment() {
  local faults="$1" experiment status started now next_fault kills=0 healed_at=0 label
  label=$([ "$faults" = 1 ] && echo "faulted" || echo "unfaulted")
  experiment=$(api POST "$API_URL/experiments" -H "Content-Type: application/json" --data-binary "@$CONFIG" \
    | json_field id)
  [ -n "$experiment" ] || die "POST /experiments returned no id"
  api POST "$API_URL/experiments/$experiment:start" >/dev/null
  log "$label experiment $experiment started"
  started=$(date +%s)
  next_fault=$((started + INTERVAL))
  while true; do
    status=$(api GET "$API_URL/experiments/$experiment" | json_field status) || status="unreachable"
    case "$status" in
      completed) break ;;
      failed|stopped|error) die "$label experiment $experiment ended with status $status after $kills pod deletions" ;;
    esac
    now=$(date +%s)
    if [ -n "$PARTITIONED" ] && [ "$now" -ge "$healed_at" ]; then heal; fi
    if [ "$faults" = 1 ] && [ "$now" -ge "$next_fault" ]; then
      if [ "$PARTITION" != 0 ] && [ "$healed_at" = 0 ]; then
        partition_random_worker && healed_at=$((now + PARTITION)) || healed_at=1
      elif [ "$kills" -lt "$MAX_KILLS" ]; then
        if delete_random_pod; then kills=$((kills + 1)); fi
      fi
      next_fault=$((now + INTERVAL))
    fi
    [ $((now - started)) -le "$TIMEOUT" ] || die "$label experiment $experiment not completed after ${TIMEOUT}s (status: $status)"
    sleep "$POLL"
  done
  heal
  log "$label experiment $experiment completed after $kills pod deletions"
  for _ in $(seq 1 30); do  # the metrics pod may itself be coming back from a kill
    api GET "$METRICS_URL/experiments/$experiment/summary" 2>/dev/null && return 0
    sleep 2
  done
  die "no summary of $experiment from the metrics service"
}

[ -n "$API_URL" ] || port_forward topology 8080 API_URL
[ -n "$METRICS_URL" ] || port_forward metrics 8081 METRICS_URL

baseline_summary=""
if [ "$COMPARE" = 1 ]; then
  if [ -n "$BASELINE" ]; then baseline_summary=$(cat "$BASELINE"); else baseline_summary=$(run_experiment 0); fi
fi
summary=$(run_experiment 1)
accuracy=$(printf '%s' "$summary" | json_field test_accuracy)
ari=$(printf '%s' "$summary" | json_field cluster_ari)
log "faulted run: test_accuracy=$accuracy cluster_ari=$ari"
printf '%s\n' "$summary"
[ "$COMPARE" = 1 ] || exit 0
verdict=$(python3 - "$baseline_summary" "$summary" "$ACCURACY_TOLERANCE" "$ARI_TOLERANCE" <<'PY'
import json
import sys

clean, faulted = json.loads(sys.argv[1]), json.loads(sys.argv[2])
accuracy_points, ari_tolerance = float(sys.argv[3]), float(sys.argv[4])


def points(value):
    return float(value) * 100.0 if float(value) <= 1.0 else float(value)


lost = points(clean["test_accuracy"]) - points(faulted["test_accuracy"])
problems = []
if lost > accuracy_points:
    problems.append(f"test accuracy {lost:.2f} points below the unfaulted run's (tolerance {accuracy_points})")
if clean.get("cluster_ari") is not None and faulted.get("cluster_ari") is not None:
    ari_lost = float(clean["cluster_ari"]) - float(faulted["cluster_ari"])
    if ari_lost > ari_tolerance:
        problems.append(f"cluster ARI {ari_lost:.3f} below the unfaulted run's (tolerance {ari_tolerance})")
print("; ".join(problems) if problems else
      f"within tolerance: accuracy {-lost:+.2f} points, unfaulted {points(clean['test_accuracy']):.2f}")
sys.exit(3 if problems else 0)
PY
) && code=0 || code=$?
log "against the unfaulted run: $verdict"
exit "$code"
