"""A private, throw-away RabbitMQ node for tests that restart or stop the broker.

The machine's default node (rabbit@<host>, port 5672) is shared and must never be stopped, so
broker-restart tests start their own node instead: its own node name, AMQP and distribution
ports, data and log folders in a temporary directory, its own Erlang cookie (a private HOME),
no plugins. It loads `broker/definitions.json`, so it also proves that file and
`broker/rabbitmq.conf` boot a real broker: vhost `dfca`, user `dfca`/`dfca`, dfca's exchanges.

    with RabbitMQNode.start_new(tmp_path) as node:
        transport = RabbitMQTransport(node.url)
        node.restart()

The server scripts are run directly from /usr/lib/rabbitmq/bin (not the Debian wrappers that
`su` to the rabbitmq user), so this works as root and as an ordinary user.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from free_ports import free_port

REPO = Path(__file__).resolve().parents[1]
BROKER_DIR = REPO / "broker"
SERVER_BIN_DIRS = (Path("/usr/lib/rabbitmq/bin"), Path("/usr/local/lib/rabbitmq/bin"))
START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 60


class RabbitMQNodeError(RuntimeError):
    """The private node could not be started or stopped."""


def server_bin_dir() -> Path | None:
    """Folder holding `rabbitmq-server` and `rabbitmqctl` proper, or None if RabbitMQ is not installed."""
    for folder in SERVER_BIN_DIRS:
        if (folder / "rabbitmq-server").exists() and (folder / "rabbitmqctl").exists():
            return folder
    return None


def node_config(source: str, definitions: Path) -> str:
    """broker/rabbitmq.conf for a node without plugins, loading definitions from `definitions`."""
    lines = [line for line in source.splitlines() if not re.match(r"^(management|prometheus)\.", line)]
    lines = [
        f"load_definitions = {definitions}" if line.startswith("load_definitions") else line
        for line in lines
    ]
    return "\n".join(lines) + "\n"


# RabbitMQ 3.10.8 (Debian's) can leave a compaction of its message store's file pending for good after a restart:
# the store defers every read of that file's messages until the compaction is done, the compactor has nothing left
# to do, and the queues holding those messages stop answering (no publish to them is confirmed, `list_queues` times
# out). Seen twice in the broker-restart test of test_broker_least_privilege. Files are compacted only once a newer
# one is written, so a node whose store never grows past one file (a test writes far less than 1 GiB) has none.
ONE_STORE_FILE = "[{rabbit, [{msg_store_file_size_limit, 1073741824}]}].\n"  # advanced.config: not a rabbitmq.conf key


class RabbitMQNode:
    """One private RabbitMQ node; `start`, `stop` and `restart` keep its data (durable queues survive)."""

    def __init__(self, base_dir: Path, bin_dir: Path, extra_config: str = "",
                 definitions: dict[str, Any] | None = None) -> None:
        self.base_dir = base_dir
        self.bin_dir = bin_dir
        self.definitions = definitions  # loaded at boot instead of broker/definitions.json
        self.extra_config = extra_config  # rabbitmq.conf lines added to broker/rabbitmq.conf's (e.g. a TLS listener)
        self.name = f"dfca-test-{secrets.token_hex(4)}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.pid_file = base_dir / "node.pid"
        self.process: subprocess.Popen[bytes] | None = None
        self._prepare()

    @classmethod
    def start_new(cls, base_dir: Path, extra_config: str = "",
                  definitions: dict[str, Any] | None = None) -> RabbitMQNode:
        bin_dir = server_bin_dir()
        if bin_dir is None:
            raise RabbitMQNodeError("RabbitMQ is not installed (run scripts/install_rabbitmq.sh)")
        node = cls(base_dir, bin_dir, extra_config, definitions)
        node.start()
        return node

    @property
    def url(self) -> str:
        return f"amqp://dfca:dfca@127.0.0.1:{self.port}/dfca"

    def _prepare(self) -> None:
        home = self.base_dir / "home"
        for folder in (home, self.base_dir / "mnesia", self.base_dir / "log"):
            folder.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        definitions = self.base_dir / "definitions.json"
        if self.definitions is None:
            shutil.copyfile(BROKER_DIR / "definitions.json", definitions)
        else:
            definitions.write_text(json.dumps(self.definitions))
        config = node_config((BROKER_DIR / "rabbitmq.conf").read_text(), definitions)
        (self.base_dir / "rabbitmq.conf").write_text(config + self.extra_config)
        (self.base_dir / "advanced.config").write_text(ONE_STORE_FILE)
        (self.base_dir / "enabled_plugins").write_text("[].\n")
        (self.base_dir / "rabbitmq-env.conf").write_text("")

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(
            HOME=str(self.base_dir / "home"),
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base_dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base_dir / "log"),
            RABBITMQ_PID_FILE=str(self.pid_file),
            RABBITMQ_CONFIG_FILE=str(self.base_dir / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base_dir / "enabled_plugins"),
            RABBITMQ_CONF_ENV_FILE=str(self.base_dir / "rabbitmq-env.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base_dir / "advanced.config"),
        )
        return env

    def ctl(self, *args: str, timeout: float = STOP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "rabbitmqctl"), "-n", self.name, *args],
            env=self.env(), capture_output=True, text=True, timeout=timeout, check=False,
        )

    def ctl_command(self) -> str:
        """A command line that runs rabbitmqctl against this node (`dfca up --rabbitmqctl`)."""
        return f"env HOME={self.base_dir / 'home'} {self.bin_dir / 'rabbitmqctl'} -n {self.name}"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.is_running():
            return
        self.pid_file.unlink(missing_ok=True)
        log = (self.base_dir / "log" / "console.log").open("ab")
        self.process = subprocess.Popen(
            [str(self.bin_dir / "rabbitmq-server")],
            env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        waited = self.ctl("wait", "--timeout", str(START_TIMEOUT_S), str(self.pid_file),
                          timeout=START_TIMEOUT_S + 30)
        if waited.returncode != 0 or not self.is_running():
            self._kill()
            raise RabbitMQNodeError(f"node {self.name} did not start: {waited.stdout}{waited.stderr}"
                                    f"\n{self.console_log()}")

    def stop(self) -> None:
        """Stop the node gracefully (connections are closed, data is kept)."""
        if not self.is_running():
            return
        assert self.process is not None
        self.ctl("stop", str(self.pid_file))
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def reset(self) -> None:
        """Restart with the data wiped: only what broker/definitions.json declares survives."""
        self.stop()
        shutil.rmtree(self.base_dir / "mnesia")
        (self.base_dir / "mnesia").mkdir()
        self.start()

    def _kill(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)

    def wait_for_port(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RabbitMQNodeError(f"port {self.port} of {self.name} did not open")

    def console_log(self) -> str:
        path = self.base_dir / "log" / "console.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def __enter__(self) -> RabbitMQNode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
