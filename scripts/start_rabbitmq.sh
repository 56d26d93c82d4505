#!/usr/bin/env bash
# Start the machine's default RabbitMQ node (rabbit@<host>, AMQP on 5672) with dfca's broker/
# configuration if it is not running yet, then make sure vhost `dfca` and an administrator of that vhost exist:
# user `dfca-admin` (full permissions on vhost `dfca`, no management tag) with a generated password, whose AMQP URL
# is written to $DFCA_BROKER_ADMIN_FILE (default ~/.dfca/broker-admin-url, mode 600). It is what the test suite,
# `python -m dfca.identity.broker_setup declare` and `dfca up --insecure-shared-broker-user` connect with; `dfca up`
# itself gives every process its own user (dfca.identity.broker_users) and needs none of it.
# A node this script boots has no `dfca`/`dfca` user (broker/definitions.json declares one for containers'
# first boot; it is left out here). On a node that was running already it changes no user but says when an
# all-powerful `dfca`/`dfca` is still there. A node it starts listens on 127.0.0.1 only. Idempotent and safe to run
# concurrently. The default node is shared: this script never stops or restarts it.
#
# Environment:
#   DFCA_RABBITMQ_PLUGINS  "broker" (default): the plugins of broker/enabled_plugins
#                          (management on 15672, prometheus on 15692);
#                          "none": no plugins, a faster start (the test suite uses this).
#   DFCA_RABBITMQ_RUN_DIR  where the generated config, pid file and lock live
#                          (default /tmp/dfca-rabbitmq).
#   DFCA_BROKER_ADMIN_FILE where the administrator's URL goes (default ~/.dfca/broker-admin-url).
#   DFCA_RABBITMQCTL       how to run rabbitmqctl (default "rabbitmqctl"; a node of one's own:
#                          "/usr/lib/rabbitmq/bin/rabbitmqctl -n NODE", with RABBITMQ_NODE_PORT its AMQP port).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${DFCA_RABBITMQ_RUN_DIR:-/tmp/dfca-rabbitmq}"
PLUGINS="${DFCA_RABBITMQ_PLUGINS:-broker}"
VHOST=dfca
ADMIN_USER=dfca-admin
ADMIN_FILE="${DFCA_BROKER_ADMIN_FILE:-$HOME/.dfca/broker-admin-url}"

SUDO=()
if [ "$(id -u)" != 0 ] && [ "$(id -un)" != rabbitmq ]; then
  SUDO=(sudo -E)
fi
read -r -a RABBITMQCTL <<< "${DFCA_RABBITMQCTL:-rabbitmqctl}"
ctl() { "${SUDO[@]}" "${RABBITMQCTL[@]}" "$@"; }

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
  # broker/definitions.json without its `dfca`/`dfca` user (Compose's first boot): no everyday all-powerful user here
  python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
d["users"] = [u for u in d["users"] if u["name"] != "dfca"]
d["permissions"] = [p for p in d["permissions"] if p["user"] != "dfca"]
json.dump(d, sys.stdout, indent=2)' "$REPO/broker/definitions.json" | "${SUDO[@]}" tee "$RUN_DIR/definitions.json" >/dev/null
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
port="${RABBITMQ_NODE_PORT:-5672}"
password=""
if [ -s "$ADMIN_FILE" ]; then  # keep the administrator's password while it still logs in
  known="$(sed -n 's#^amqp://[^:]*:\([^@]*\)@.*#\1#p' "$ADMIN_FILE" | head -n 1)"
  if [ -n "$known" ] && ctl -q authenticate_user "$ADMIN_USER" "$known" >/dev/null 2>&1; then
    password="$known"
  fi
fi
if [ -z "$password" ]; then
  password="$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')"
  if ctl -q list_users | awk '{print $1}' | grep -qx "$ADMIN_USER"; then
    ctl change_password "$ADMIN_USER" "$password" >/dev/null
  else
    ctl add_user "$ADMIN_USER" "$password" >/dev/null
  fi
fi
ctl set_user_tags "$ADMIN_USER" >/dev/null  # no management or administrator tag: AMQP on vhost dfca only
ctl set_permissions -p "$VHOST" "$ADMIN_USER" '.*' '.*' '.*' >/dev/null
mkdir -p "$(dirname "$ADMIN_FILE")"
(umask 077 && echo "amqp://$ADMIN_USER:$password@127.0.0.1:$port/$VHOST" > "$ADMIN_FILE")
if ctl -q authenticate_user dfca dfca >/dev/null 2>&1; then
  echo "start_rabbitmq.sh: this node still has user dfca with password dfca and all rights on vhost $VHOST;" \
    "nothing needs it any more: rabbitmqctl delete_user dfca" >&2
fi
echo "RabbitMQ is up on 127.0.0.1:$port; the administrator's URL of vhost $VHOST is in $ADMIN_FILE"
