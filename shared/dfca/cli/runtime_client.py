"""A client of the runtime's two REST APIs (topology and metrics), for `dfca submit|status|stop|logs|results`.

Every failure becomes `ApiError` with a message a user can act on: which service could not be reached and how to
start it, a missing token, an unknown experiment, a refused start, or a config's field errors.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_TOPOLOGY_URL = "http://127.0.0.1:8080"
DEFAULT_METRICS_URL = "http://127.0.0.1:8081"
TERMINAL = ("completed", "failed", "stopped")
METRICS_DOWN_LIMIT_S = 30.0  # `follow` gives up on a metrics service that refuses connections this long


class ApiError(RuntimeError):
    """A REST call that failed; the message says why and what to do. `status`: the HTTP status, if one came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServiceUnreachable(ApiError):
    """No connection to a service at all (not running, wrong URL)."""


class WaitTimedOut(TimeoutError):
    """`follow` passed its deadline before the experiment ended (the experiment itself keeps running)."""


@dataclass(frozen=True)
class Endpoints:
    topology: str
    metrics: str
    token: str
    source: str = ""  # where the URLs came from, when not from an option or the environment (said in errors)

    @classmethod
    def resolve(cls, topology: str | None, metrics: str | None, token: str | None) -> Endpoints:
        """Each of the three from, in order: its flag; DFCA_TOPOLOGY_URL, DFCA_METRICS_URL, DFCA_API_TOKEN (else
        DFCA_READ_TOKEN, enough to read); the state file of a running `dfca up` (dfca.cli.stack_state: its URLs and
        the token file it made); the `dfca up` defaults."""
        from dfca.cli import stack_state

        topology = topology or os.environ.get("DFCA_TOPOLOGY_URL")
        metrics = metrics or os.environ.get("DFCA_METRICS_URL")
        if token is None:
            token = os.environ.get("DFCA_API_TOKEN") or os.environ.get("DFCA_READ_TOKEN") or None
        source = ""
        if topology is None or metrics is None or token is None:
            state, stale = stack_state.find()
            if state is not None:
                used = [name for name, value in (("topology", topology), ("metrics", metrics)) if value is None]
                topology = topology or state.topology_url
                metrics = metrics or state.metrics_url
                if token is None and state.token():
                    token, used = state.token(), [*used, "token"]
                source = f"{' and '.join(used)} read from {state.path} (the `dfca up` of pid {state.pid})"
            elif stale and (topology is None or metrics is None):
                source = (f"{stale[0].path} was not used: the `dfca up` that wrote it (pid {stale[0].pid}) is gone; "
                          "`dfca down` removes it")
        return cls((topology or DEFAULT_TOPOLOGY_URL).rstrip("/"), (metrics or DEFAULT_METRICS_URL).rstrip("/"),
                   token or "", source)


class RuntimeClient:
    """Both services' REST calls. `transport`: an httpx transport for both (tests pass an `httpx.MockTransport`)."""

    def __init__(self, endpoints: Endpoints, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.endpoints = endpoints
        headers = {"Authorization": f"Bearer {endpoints.token}"} if endpoints.token else {}
        self.topology = httpx.Client(base_url=endpoints.topology, timeout=timeout, headers=headers,
                                     transport=transport)
        self.metrics = httpx.Client(base_url=endpoints.metrics, timeout=timeout, headers=headers,
                                    transport=transport)

    def close(self) -> None:
        self.topology.close()
        self.metrics.close()

    # -- calls -------------------------------------------------------------------------------------------------
    def _call(self, client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
        service = "topology" if client is self.topology else "metrics"
        try:
            response = client.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise self._unreachable(client, err) from err
        if response.status_code < 400:
            return response
        detail = _detail(response)
        if response.status_code == 401:
            raise ApiError(f"the {service} service refused the call (401: {detail}); set DFCA_API_TOKEN or --token "
                           "to the stack's API token", 401)
        if response.status_code == 422:
            raise ApiError(f"the config was refused: {detail}", 422)
        if response.status_code == 404 and path.startswith("/experiments/"):
            experiment = path[len("/experiments/"):].split("/")[0].split(":")[0]
            raise ApiError(f"unknown experiment {experiment!r} on the {service} service at {client.base_url} "
                           f"({detail}); `dfca status` lists the experiments there", 404)
        raise ApiError(f"{method} {client.base_url}{path}: {response.status_code} {detail}", response.status_code)

    def _unreachable(self, client: httpx.Client, err: Exception) -> ServiceUnreachable:
        service = "topology" if client is self.topology else "metrics"
        source = f"; {self.endpoints.source}" if self.endpoints.source else ""
        return ServiceUnreachable(f"cannot reach the {service} service at {client.base_url} ({type(err).__name__})"
                                  f"{source}; is the stack running? Start it with `dfca up`, or point "
                                  f"DFCA_{service.upper()}_URL (or --{service}) at it")

    def create(self, config: dict[str, Any]) -> str:
        return str(self._call(self.topology, "POST", "/experiments", json=config).json()["id"])

    def start(self, experiment: str) -> dict[str, Any]:
        return dict(self._call(self.topology, "POST", f"/experiments/{experiment}:start").json())

    def stop(self, experiment: str) -> dict[str, Any]:
        return dict(self._call(self.topology, "POST", f"/experiments/{experiment}:stop").json())

    def experiment(self, experiment: str) -> dict[str, Any]:
        return dict(self._call(self.topology, "GET", f"/experiments/{experiment}").json())

    def experiments(self) -> list[dict[str, Any]]:
        return list(self._call(self.topology, "GET", "/experiments").json())

    def deployment(self) -> dict[str, Any]:
        """The workers and the aggregator the topology service knows (GET /deployment)."""
        return dict(self._call(self.topology, "GET", "/deployment").json())

    def summary(self, experiment: str) -> dict[str, Any] | None:
        """The metrics service's summary, or None when it has not heard of the experiment (yet)."""
        try:
            return dict(self._call(self.metrics, "GET", f"/experiments/{experiment}/summary").json())
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def history(self, experiment: str) -> dict[str, Any]:
        return dict(self._call(self.metrics, "GET", f"/experiments/{experiment}/metrics").json())

    def files(self, experiment: str, kind: str) -> dict[str, bytes] | None:
        """Every file of `kind` ("models" or "plots") of an experiment; None when the service has none."""
        try:
            names = self._call(self.metrics, "GET", f"/experiments/{experiment}/{kind}").json()["files"]
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return {name: self._call(self.metrics, "GET", f"/experiments/{experiment}/{kind}/{name}").content
                for name in names}

    def events(self, experiment: str, deadline: float | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """The experiment's server-sent events (progress, status, summary) until the stream ends or breaks.
        `deadline` (time.monotonic()): raise WaitTimedOut once it passes, checked on every line (the service
        sends a keepalive comment every 15 s) and bounding each read."""
        read = 60.0 if deadline is None else max(0.1, min(60.0, deadline - time.monotonic()))
        try:
            with self.metrics.stream("GET", f"/experiments/{experiment}/events",
                                     timeout=httpx.Timeout(10.0, read=read)) as response:
                if response.status_code == 404:
                    return
                if response.status_code >= 400:
                    raise ApiError(f"events of {experiment}: {response.status_code} {response.read()[:200]!r}",
                                   response.status_code)
                event = ""
                for line in response.iter_lines():
                    _check(deadline)
                    if line.startswith("event: "):
                        event = line[len("event: "):]
                    elif line.startswith("data: ") and event:
                        yield event, json.loads(line[len("data: "):])
                        event = ""
        except httpx.ConnectError as err:
            raise self._unreachable(self.metrics, err) from err
        except httpx.TransportError:  # the stream broke or went quiet: the caller reconnects or polls
            _check(deadline)
            return

    def follow(self, experiment: str, poll_s: float = 1.0,
               deadline: float | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events until the experiment ends, reconnecting when the stream breaks or the metrics service has not
        heard of the experiment yet; ends with the stream's `summary` event or, when the stream ended without
        one, a `status` event of the terminal status. Raises WaitTimedOut once `deadline` (monotonic) passes,
        ServiceUnreachable when the metrics service refuses connections for METRICS_DOWN_LIMIT_S (a restart by
        `dfca up` is shorter)."""
        down_since: float | None = None
        while True:
            try:
                for event, data in self.events(experiment, deadline):
                    yield event, data
                    if event == "summary":
                        return
            except ServiceUnreachable:
                down_since = down_since if down_since is not None else time.monotonic()
                if time.monotonic() - down_since >= METRICS_DOWN_LIMIT_S:
                    raise
            else:
                down_since = None
            record = self.experiment(experiment)
            if record["status"] in TERMINAL:
                yield "status", {"status": record["status"], "failed_clients": record.get("failed_clients", [])}
                return
            _check(deadline)
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise WaitTimedOut()


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        return response.text[:500]
    if isinstance(detail, list):  # pydantic's field errors
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:]) or 'config'}: {e.get('msg')}"
                         for e in detail)
    return str(detail)
