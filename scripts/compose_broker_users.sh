#!/usr/bin/env bash
# One broker user per service and per worker for docker-compose.yml (docs/security.md): generates their
# passwords, writes the broker's definitions (hashes only) to .dfca/broker-definitions.json and each
# principal's URL into .env (DFCA_BROKER_URL_TOPOLOGY, ..._WORKER_0, ...), which docker-compose.yml reads.
# Run it before the first `docker compose up` (or again to change every password, then recreate the stack:
# `docker compose up -d --force-recreate`). WORKERS (default 3) must match the worker-N services.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .dfca
python3 -m dfca.identity.broker_users definitions --workers "${WORKERS:-3}" --host rabbitmq \
  --out .dfca/broker-users.json --compose-env .env --definitions-path ./.dfca/broker-definitions.json \
  > .dfca/broker-definitions.tmp
mv .dfca/broker-definitions.tmp .dfca/broker-definitions.json
echo "broker users for docker compose: .dfca/broker-definitions.json and .env (DFCA_BROKER_URL_*)" >&2
