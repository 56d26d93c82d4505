#!/usr/bin/env bash
# Create dfca's Secrets in the namespace (default dfca) with random values, each set only if it does not
# exist. It never overwrites: re-running it, or re-applying k8s/ (which holds no Secret), keeps what an
# operator set.
#   dfca-secrets                 api-token (create, start, stop) and read-token (reads)
#   dfca-broker-users            the broker's users.json, permissions.json, topic_permissions.json: one broker
#                                user per service and per worker ordinal, password hashes and least-privilege
#                                rights (python -m dfca.identity.broker_users k8s); the broker pod loads them at boot
#   dfca-broker-<principal>      url: the AMQP URL of topology, metrics, aggregator, worker-0 .. worker-N-1,
#                                each mounted by that workload only
#   bash scripts/k8s_secret.sh [NAMESPACE]
# WORKERS (default: the worker StatefulSets in k8s/worker.yaml) sets how many worker users are made,
# BROKER_HOST (default rabbitmq) the broker's host in the URLs. Needs
# kubectl, openssl and Python 3 with this project installed (or run from its checkout).
# Rotate or re-size the broker users: kubectl -n NAMESPACE delete secret -l dfca.dev/broker-users=true,
# run this again, then restart the broker and every dfca workload (docs/deployment.md).
set -euo pipefail
NAMESPACE="${1:-dfca}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORKERS="${WORKERS:-$(grep -c '^kind: StatefulSet' "$REPO/k8s/worker.yaml" || true)}"
case "$WORKERS" in
  "" | 0 | *[!0-9]*) echo "WORKERS must be a positive number (found '$WORKERS')" >&2; exit 1 ;;
esac
PRINCIPALS=(topology metrics aggregator)
for ((i = 0; i < WORKERS; i++)); do PRINCIPALS+=("worker-$i"); done

exists() { kubectl -n "$NAMESPACE" get secret "$1" >/dev/null 2>&1; }

if exists dfca-secrets; then
  echo "secret $NAMESPACE/dfca-secrets exists; kept as it is"
else
  kubectl -n "$NAMESPACE" create secret generic dfca-secrets \
    --from-literal=api-token="$(openssl rand -hex 32)" \
    --from-literal=read-token="$(openssl rand -hex 32)"
  kubectl -n "$NAMESPACE" label secret dfca-secrets app.kubernetes.io/part-of=dfca >/dev/null
  echo "created secret $NAMESPACE/dfca-secrets (read the API token with: kubectl -n $NAMESPACE get secret" \
    "dfca-secrets -o jsonpath='{.data.api-token}' | base64 -d)"
fi

if exists dfca-broker-users; then
  missing=()
  for principal in "${PRINCIPALS[@]}"; do
    exists "dfca-broker-$principal" || missing+=("$principal")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "the broker users exist but not for ${missing[*]} ($WORKERS workers asked). To re-size, make them all" \
      "again: kubectl -n $NAMESPACE delete secret -l dfca.dev/broker-users=true, run this script, then restart" \
      "the broker and every dfca workload (docs/deployment.md, 'Scaling the workers')" >&2
    exit 1
  fi
  echo "broker users in $NAMESPACE (dfca-broker-users, dfca-broker-<principal>) exist; kept as they are"
  exit 0
fi

if ! "$PYTHON" -c "import dfca.identity.broker_users" 2>/dev/null; then
  export PYTHONPATH="$REPO/shared${PYTHONPATH:+:$PYTHONPATH}"
  "$PYTHON" -c "import dfca.identity.broker_users" || {
    echo "cannot import dfca.identity.broker_users: install the project first (pip install -e .)" >&2; exit 1; }
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m dfca.identity.broker_users k8s --workers "$WORKERS" --host "${BROKER_HOST:-rabbitmq}" --out-dir "$work"
# An earlier run that stopped part-way left some principals' Secrets without the broker's: make them anew.
kubectl -n "$NAMESPACE" delete secret -l dfca.dev/broker-users=true --ignore-not-found >/dev/null
for principal in "${PRINCIPALS[@]}"; do
  kubectl -n "$NAMESPACE" create secret generic "dfca-broker-$principal" --from-file=url="$work/url-$principal" \
    >/dev/null
  kubectl -n "$NAMESPACE" label secret "dfca-broker-$principal" app.kubernetes.io/part-of=dfca \
    dfca.dev/broker-users=true >/dev/null
done
kubectl -n "$NAMESPACE" create secret generic dfca-broker-users --from-file=users.json="$work/users.json" \
  --from-file=permissions.json="$work/permissions.json" \
  --from-file=topic_permissions.json="$work/topic_permissions.json" >/dev/null
kubectl -n "$NAMESPACE" label secret dfca-broker-users app.kubernetes.io/part-of=dfca dfca.dev/broker-users=true \
  >/dev/null
echo "created the broker users of ${#PRINCIPALS[@]} principals in $NAMESPACE (dfca-broker-users," \
  "dfca-broker-<principal>); a broker that booted without them needs a restart: kubectl -n $NAMESPACE rollout" \
  "restart statefulset rabbitmq"
