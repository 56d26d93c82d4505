#!/usr/bin/env bash
# Start the machine's default RabbitMQ node (rabbit@<host>, AMQP on 5672) with dfca's broker/
# configuration if it is not running yet, then make sure vhost `dfca` and user `dfca`/`dfca`
# (local development only; no management tag) exist with full permissions on that vhost. A node it starts
# listens on 127.0.0.1 only. Idempotent and safe to run
# concurrently. The default node is shared: this script never stops or restarts it.
#
# Environment:
#   DFCA_RABBITMQ_PLUGINS  "broker" (default): the plugins of broker/enabled_plugins
#                          (management on 15672, prometheus on 15692);
#                          "none": no plugins, a faster start (the test suite uses this).
#   DFCA_RABBITMQ_RUN_DIR  where the generated config, pid file and lock live
#                          (default /tmp/dfca-rabbitmq).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${DFCA_RABBITMQ_RUN_DIR:-/tmp/dfca-rabbitmq}"
PLUGINS="${DFCA_RABBITMQ_PLUGINS:-broker}"
VHOST=dfca
USER_NAME=dfca
USER_PASSWORD=dfca

SUDO=()
if [ "$(id -u)" != 0 ] && [ "$(id -un)" != rabbitmq ]; then
  SUDO=(sudo -E)
fi
ctl() { "${SUDO[@]}" rabbitmqctl "$@"; }

if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
  echo "start_rabbitmq.sh: rabbitmq-server is not installed; run scripts/install_rabbitmq.sh" >&2
  exit 1
fi
export PATH="$PATH:/usr/sbin:/usr/lib/rabbitmq/bin"

"${SUDO[@]}" mkdir -p "$RUN_DIR"
exec 9>>"$RUN_DIR/start-script.lock"
# One starter at a time; the others find the node running. (The server must not inherit fd 9.)
flock -w 180 9

if ctl -q status >/dev/null 2>&1; then
  echo "RabbitMQ is already running"
else
  echo "Starting RabbitMQ (plugins: $PLUGINS)"
  "${SUDO[@]}" cp "$REPO/broker/definitions.json" "$RUN_DIR/definitions.json"
  if [ "$PLUGINS" = none ]; then
    echo '[].' | "${SUDO[@]}" tee "$RUN_DIR/enabled_plugins" >/dev/null
    conf_filter='^(management|prometheus)\.'
  else
    "${SUDO[@]}" cp "$REPO/broker/enabled_plugins" "$RUN_DIR/enabled_plugins"
    conf_filter='^$'
  fi
  # A local node listens on loopback only (AMQP, and the management UI and Prometheus when enabled);
  # containers and Kubernetes use broker/rabbitmq.conf as it is.
  {
    grep -Ev "$conf_filter" "$REPO/broker/rabbitmq.conf" \
      | sed -e "s#^load_definitions = .*#load_definitions = $RUN_DIR/definitions.json#"
    echo "listeners.tcp.local = 127.0.0.1:${RABBITMQ_NODE_PORT:-5672}"
    if [ "$PLUGINS" != none ]; then
      echo "management.tcp.ip = 127.0.0.1"
      echo "prometheus.tcp.ip = 127.0.0.1"
    fi
  } | "${SUDO[@]}" tee "$RUN_DIR/rabbitmq.conf" >/dev/null
  if id rabbitmq >/dev/null 2>&1; then
    "${SUDO[@]}" chown -R rabbitmq "$RUN_DIR"
  fi
  boot() {  # start the node detached and wait (bounded) until its applications run
    "${SUDO[@]}" rm -f "$RUN_DIR/rabbitmq.pid"
    "${SUDO[@]}" env \
      RABBITMQ_CONFIG_FILE="$RUN_DIR/rabbitmq.conf" \
      RABBITMQ_ENABLED_PLUGINS_FILE="$RUN_DIR/enabled_plugins" \
      RABBITMQ_PID_FILE="$RUN_DIR/rabbitmq.pid" \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
      "$@" rabbitmq-server -detached 9>&-
    timeout 150 "${SUDO[@]}" rabbitmqctl wait --timeout 120 "$RUN_DIR/rabbitmq.pid"
  }
  if ! boot; then
    # A node that does not boot (seen once in CI: stuck waiting for its applications) must fail this script,
    # not hang it: show why, then try once more with a fresh database of our own.
    echo "RabbitMQ did not boot within 150 s; the end of its log:" >&2
    tail -n 40 /var/log/rabbitmq/*.log 2>/dev/null >&2 || true
    if [ -s "$RUN_DIR/rabbitmq.pid" ]; then
      "${SUDO[@]}" kill -9 "$(cat "$RUN_DIR/rabbitmq.pid")" 2>/dev/null || true
    fi
    sleep 2
    fresh="$RUN_DIR/mnesia-$(date +%s)"
    "${SUDO[@]}" mkdir -p "$fresh"
    if id rabbitmq >/dev/null 2>&1; then "${SUDO[@]}" chown -R rabbitmq "$RUN_DIR"; fi
    echo "Starting RabbitMQ again with its database in $fresh" >&2
    boot RABBITMQ_MNESIA_BASE="$fresh"
  fi
fi

# Works on a node started elsewhere (systemd, another script) too.
ctl -q list_vhosts | grep -qx "$VHOST" || ctl add_vhost "$VHOST"
if ! ctl -q list_users | awk '{print $1}' | grep -qx "$USER_NAME"; then
  ctl add_user "$USER_NAME" "$USER_PASSWORD"
fi
ctl set_user_tags "$USER_NAME"  # least privilege: the app user needs no management or administrator tag
ctl set_permissions -p "$VHOST" "$USER_NAME" '.*' '.*' '.*'
echo "RabbitMQ is up: amqp://$USER_NAME:$USER_PASSWORD@127.0.0.1:${RABBITMQ_NODE_PORT:-5672}/$VHOST"
