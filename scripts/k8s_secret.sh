#!/usr/bin/env bash
# Create dfca's Secrets in the namespace (default dfca) with random values, each only if it does not exist. It
# never overwrites: re-running it, or re-applying k8s/ (which holds no Secret), keeps what an operator set.
#   dfca-secrets                 api-token (create, start, stop) and read-token (reads)
#   dfca-broker-users            the broker's users.json, permissions.json, topic_permissions.json: one broker
#                                user per service and per worker ordinal, password hashes and least-privilege
#                                rights; the broker pod loads them at boot
#   dfca-broker-<principal>      url: the AMQP URL of topology, metrics, aggregator, worker-0 .. worker-N-1,
#                                each mounted by that workload only
#   bash scripts/k8s_secret.sh [NAMESPACE]
# More workers later (WORKERS=N): only the new workers' users are made; everyone else keeps their password, and
# the new users are imported into the running broker (rabbitmqctl import_definitions): no broker restart.
# WORKERS (default: the worker StatefulSets in k8s/worker.yaml), BROKER_HOST (default rabbitmq) the broker's host
# in the URLs. Needs kubectl and openssl. The passwords and hashes are made by dfca.identity.broker_users: with
# this machine's Python where it imports dfca (a checkout or an install), otherwise in a short-lived pod of the dfca
# image (IMAGE, default dfca:0.1.0; a site's registry image works) that prints them and is deleted.
# Rotate every broker user: kubectl -n NAMESPACE delete secret -l dfca.dev/broker-users=true, run this again,
# then restart the broker and every dfca workload (docs/deployment.md).
set -euo pipefail
NAMESPACE="${1:-dfca}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
IMAGE="${IMAGE:-dfca:0.1.0}"
WORKERS="${WORKERS:-$(grep -c '^kind: StatefulSet' "$REPO/k8s/worker.yaml" 2>/dev/null || true)}"
case "$WORKERS" in
  "" | 0 | *[!0-9]*) echo "WORKERS must be a positive number (found '$WORKERS')" >&2; exit 1 ;;
esac
PRINCIPALS=(topology metrics aggregator)
for ((i = 0; i < WORKERS; i++)); do PRINCIPALS+=("worker-$i"); done
RECORDS=(users permissions topic_permissions)

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

have_users=0
exists dfca-broker-users && have_users=1
missing=()
for principal in "${PRINCIPALS[@]}"; do
  if [ "$have_users" = 0 ] || ! exists "dfca-broker-$principal"; then missing+=("$principal"); fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "broker users in $NAMESPACE (dfca-broker-users, dfca-broker-<principal>) exist; kept as they are"
  exit 0
fi

# Print "<file> <base64>" lines: each missing principal's url-<principal> and the broker's records of them.
GENERATE='
import base64, json, secrets, sys
from dfca.identity.broker_users import principal_records, principal_url
host, principals = sys.argv[1], sys.argv[2:]
passwords = {p: secrets.token_urlsafe(24) for p in principals}
files = {f"{key}.json": json.dumps(value) for key, value in principal_records(passwords).items()}
files.update({f"url-{p}": principal_url(p, pw, host, 5672) for p, pw in passwords.items()})
for name, text in files.items():
    print(name, base64.b64encode(text.encode()).decode())
'
generate() {
  if "$PYTHON" -c "import dfca.identity.broker_users" 2>/dev/null; then
    "$PYTHON" -c "$GENERATE" "$@"
  elif PYTHONPATH="$REPO/shared" "$PYTHON" -c "import dfca.identity.broker_users" 2>/dev/null; then
    PYTHONPATH="$REPO/shared" "$PYTHON" -c "$GENERATE" "$@"
  else
    local pod="dfca-broker-users-$RANDOM" args
    args=$(printf '"%s",' "$@")
    echo "making the broker users in a pod of $IMAGE (no local Python with dfca)" >&2
    kubectl -n "$NAMESPACE" run "$pod" --rm -i --quiet --restart=Never --image="$IMAGE" --overrides='{
      "apiVersion": "v1",
      "spec": {
        "automountServiceAccountToken": false,
        "securityContext": {"runAsNonRoot": true, "runAsUser": 10001, "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "'"$pod"'", "image": "'"$IMAGE"'",
                        "command": ["python", "-c", '"$(printf '%s' "$GENERATE" | python_free_json)"', '"${args%,}"'],
                        "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                            "capabilities": {"drop": ["ALL"]}},
                        "resources": {"limits": {"cpu": "500m", "memory": "512Mi"}}}]}}'
  fi
}
python_free_json() {  # stdin as a JSON string, with sed alone
  printf '"'; sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | sed -e ':a;N;$!ba;s/\n/\\n/g' | tr -d '\n'; printf '"'
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
generate "${BROKER_HOST:-rabbitmq}" "${missing[@]}" > "$work/bundle"
while read -r name data; do
  case "$name" in
    users.json | permissions.json | topic_permissions.json | url-*) printf '%s' "$data" | base64 -d > "$work/$name" ;;
  esac
done < "$work/bundle"
for principal in "${missing[@]}"; do
  [ -s "$work/url-$principal" ] || { echo "no broker user was made for $principal" >&2; exit 1; }
done

merge_array() {  # two JSON arrays -> one
  local first second
  first="$(tr -d '\n' < "$1")"; second="$(tr -d '\n' < "$2")"
  first="${first%]}"; second="${second#[}"
  case "$first" in *"{"*) printf '%s, %s' "$first" "$second" ;; *) printf '[%s' "$second" ;; esac
}
if [ "$have_users" = 1 ]; then  # more workers: keep everyone's records, add the new ones
  for part in "${RECORDS[@]}"; do
    kubectl -n "$NAMESPACE" get secret dfca-broker-users -o "jsonpath={.data.${part}\\.json}" | base64 -d \
      > "$work/old-$part.json"
    merge_array "$work/old-$part.json" "$work/$part.json" > "$work/all-$part.json"
  done
else
  for part in "${RECORDS[@]}"; do cp "$work/$part.json" "$work/all-$part.json"; done
  # an earlier run that stopped part-way left some principals' Secrets without the broker's: make them anew
  kubectl -n "$NAMESPACE" delete secret -l dfca.dev/broker-users=true --ignore-not-found >/dev/null
fi
for principal in "${missing[@]}"; do
  kubectl -n "$NAMESPACE" delete secret "dfca-broker-$principal" --ignore-not-found >/dev/null
  kubectl -n "$NAMESPACE" create secret generic "dfca-broker-$principal" --from-file=url="$work/url-$principal" \
    >/dev/null
  kubectl -n "$NAMESPACE" label secret "dfca-broker-$principal" app.kubernetes.io/part-of=dfca \
    dfca.dev/broker-users=true >/dev/null
done
kubectl -n "$NAMESPACE" delete secret dfca-broker-users --ignore-not-found >/dev/null
kubectl -n "$NAMESPACE" create secret generic dfca-broker-users --from-file=users.json="$work/all-users.json" \
  --from-file=permissions.json="$work/all-permissions.json" \
  --from-file=topic_permissions.json="$work/all-topic_permissions.json" >/dev/null
kubectl -n "$NAMESPACE" label secret dfca-broker-users app.kubernetes.io/part-of=dfca dfca.dev/broker-users=true \
  >/dev/null
if [ "$have_users" = 0 ]; then
  echo "created the broker users of ${#missing[@]} principals in $NAMESPACE (dfca-broker-users," \
    "dfca-broker-<principal>); a broker that booted without them needs a restart: kubectl -n $NAMESPACE rollout" \
    "restart statefulset rabbitmq"
  exit 0
fi
printf '{"users": %s, "permissions": %s, "topic_permissions": %s}\n' "$(cat "$work/users.json")" \
  "$(cat "$work/permissions.json")" "$(cat "$work/topic_permissions.json")" > "$work/new.json"
if kubectl -n "$NAMESPACE" exec -i rabbitmq-0 -c rabbitmq -- rabbitmqctl import_definitions --format json \
    < "$work/new.json" >/dev/null; then
  echo "added the broker users of ${missing[*]} in $NAMESPACE and imported them into the running broker"
else
  echo "added the broker users of ${missing[*]} to the Secrets, but could not import them into the running broker:" \
    "restart it (kubectl -n $NAMESPACE rollout restart statefulset rabbitmq) or retry" >&2
  exit 1
fi
