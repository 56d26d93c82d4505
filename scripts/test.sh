#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need on a fresh Debian/Ubuntu
# machine -- torch 2.13.0 (CPU) first, then the project, RabbitMQ, docker-compose, and Chromium with its driver
# for the dashboard's browser test -- and runs ruff and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
bash scripts/install_rabbitmq.sh
bash scripts/start_rabbitmq.sh
missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)            # the dashboard's browser test
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  timeout 900 apt-get update -q >/dev/null
  timeout 900 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
python3 -m ruff check shared services tests benchmarks scripts
# --durations: the slowest tests are named in every log (a test that hangs fails at pyproject's per-test timeout)
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
