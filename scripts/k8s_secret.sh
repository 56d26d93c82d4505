#!/usr/bin/env bash
# Create the Secret `dfca-secrets` (broker-password, broker-url, api-token) with random values in the
# namespace (default dfca), unless it exists. It never overwrites: re-running it, or re-applying k8s/
# (which holds no Secret), keeps the secret an operator set. Needs kubectl and openssl.
#   bash scripts/k8s_secret.sh [NAMESPACE]
# Rotate by deleting the Secret, running this again, and restarting the broker and the dfca workloads.
set -euo pipefail
NAMESPACE="${1:-dfca}"
if kubectl -n "$NAMESPACE" get secret dfca-secrets >/dev/null 2>&1; then
  echo "secret $NAMESPACE/dfca-secrets exists; kept as it is"
  exit 0
fi
# broker-password is embedded in broker-url and in RabbitMQ's definitions: letters and digits only (hex).
PASSWORD="$(openssl rand -hex 24)"
TOKEN="$(openssl rand -hex 32)"
kubectl -n "$NAMESPACE" create secret generic dfca-secrets \
  --from-literal=broker-password="$PASSWORD" \
  --from-literal=broker-url="amqp://dfca:$PASSWORD@rabbitmq:5672/dfca" \
  --from-literal=api-token="$TOKEN"
kubectl -n "$NAMESPACE" label secret dfca-secrets app.kubernetes.io/part-of=dfca >/dev/null
echo "created secret $NAMESPACE/dfca-secrets (read the API token with: kubectl -n $NAMESPACE get secret" \
  "dfca-secrets -o jsonpath='{.data.api-token}' | base64 -d)"
