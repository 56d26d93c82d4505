#!/usr/bin/env bash
# Broker users for docker-compose.yml, which refuses to start without them.
#   bash scripts/compose_broker_users.sh                 one user per service and per worker (docs/security.md):
#       generates their passwords, writes the broker's definitions (hashes only) to .dfca/broker-definitions.json
#       and each principal's URL into .env (DFCA_BROKER_URL_TOPOLOGY, ..._WORKER_0, ...; mode 600)
#   bash scripts/compose_broker_users.sh --shared-user   every process as the one development user dfca/dfca of
#       broker/definitions.json: an explicit opt-in for a throwaway local stack; the services warn at start that
#       they cannot tell publishers apart
# Both modes also put an API token and a read token (DFCA_API_TOKEN, DFCA_READ_TOKEN) into .env where it has
# none yet: reads of both APIs need one of them, and the workers hold only the read token.
# Run it before the first `docker compose up` (or again to change every password, then recreate the stack:
# `docker compose up -d --force-recreate`). WORKERS (default 3) must match the worker-N services. Needs Python 3
# with this project installed, or run from its checkout (with pydantic and torch importable).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS="${WORKERS:-3}"
ENV_FILE="${ENV_FILE:-.env}"
mode=principals
case "${1:-}" in
  "") ;;
  --shared-user) mode=shared ;;
  *) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import dfca.identity.broker_users" 2>/dev/null || export PYTHONPATH="$PWD/shared${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - "$ENV_FILE" <<'PY'
import secrets
import sys
from pathlib import Path

from dfca.identity.broker_users import update_env_file

env = Path(sys.argv[1])
held = {line.split("=", 1)[0].strip() for line in env.read_text().splitlines()} if env.exists() else set()
tokens = {name: secrets.token_hex(32) for name in ("DFCA_API_TOKEN", "DFCA_READ_TOKEN") if name not in held}
if tokens:
    update_env_file(env, tokens)
    print(f"API tokens for docker compose: {', '.join(tokens)} in {env}", file=sys.stderr)
PY
if [ "$mode" = shared ]; then
  "$PYTHON" - "$ENV_FILE" "$WORKERS" <<'PY'
import sys
from pathlib import Path

from dfca.identity.broker_users import env_name, principals_of, update_env_file

shared = "amqp://dfca:dfca@rabbitmq:5672/dfca"
values = {env_name(p): shared for p in principals_of(int(sys.argv[2]))}
update_env_file(Path(sys.argv[1]), {**values, "DFCA_BROKER_DEFINITIONS": "./broker/definitions.json"})
PY
  echo "WARNING: every compose service connects as the shared development user dfca/dfca ($ENV_FILE): the" \
    "broker cannot tell a worker from the topology service. Run this script without --shared-user for one" \
    "user per principal." >&2
  exit 0
fi
mkdir -p .dfca
"$PYTHON" -m dfca.identity.broker_users definitions --workers "$WORKERS" --host rabbitmq \
  --out .dfca/broker-users.json --compose-env "$ENV_FILE" --definitions-path ./.dfca/broker-definitions.json \
  > .dfca/broker-definitions.tmp
mv .dfca/broker-definitions.tmp .dfca/broker-definitions.json
echo "broker users for docker compose: .dfca/broker-definitions.json and $ENV_FILE (DFCA_BROKER_URL_*)" >&2
