#!/usr/bin/env bash
# Install the RabbitMQ server (Debian/Ubuntu package) if it is missing. Idempotent.
# Does not start the broker: scripts/start_rabbitmq.sh does.
set -euo pipefail

if command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_rabbitmq.sh: rabbitmq-server is missing and apt-get is not available" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install_rabbitmq.sh: installing rabbitmq-server needs root: run as root or install sudo" >&2
    exit 1
  fi
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends rabbitmq-server
# Debian starts the service after install where systemd runs; the start script copes with both.
