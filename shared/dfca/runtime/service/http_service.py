"""What every service's HTTP side shares: /livez and /readyz, bearer-token auth, and a uvicorn runner.

Tokens: mutating calls carry the API token (DFCA_API_TOKEN). Reads need a token whenever any token is set: every
read but OPEN_PATHS carries the read token (DFCA_READ_TOKEN) or the API token, as `Authorization: Bearer <token>`
or, for a browser's EventSource (which cannot set headers), `?access_token=<token>`. Only a service with neither token
serves reads to anyone.

`/livez` answers 200 while the process serves HTTP. `/readyz` answers 200 only when the broker
accepts a connection (a fresh, short AMQP handshake) and the service's own check passes, else 503.
`serve` returns after SIGTERM or Ctrl-C (uvicorn's handlers), so callers can shut down cleanly.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from urllib.parse import unquote_plus

import pika
import pika.exceptions
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dfca.settings import env

log = logging.getLogger(__name__)


def broker_reachable(url: str, timeout: float = 3.0) -> bool:
    if url.startswith("memory://"):
        return True
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = timeout
    params.blocked_connection_timeout = timeout
    params.stack_timeout = timeout
    try:
        pika.BlockingConnection(params).close()
    except (pika.exceptions.AMQPError, OSError):
        return False
    return True


def add_health_routes(app: FastAPI, broker_url: str, ready: Callable[[], bool] = lambda: True) -> None:
    @app.get("/livez", include_in_schema=False)
    def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    def readyz() -> JSONResponse:
        broker = broker_reachable(broker_url)
        own = ready()
        body = {"status": "ok" if broker and own else "unavailable", "broker": broker, "service": own}
        return JSONResponse(body, status_code=200 if broker and own else 503)


def bearer_auth(token: str | None) -> Callable[..., None]:
    """A FastAPI dependency: `Authorization: Bearer <token>` must match; with no token configured, 401 always."""

    def check(authorization: str | None = Header(default=None)) -> None:
        if not token_matches(token, authorization):
            raise HTTPException(401, refusal(token), headers={"WWW-Authenticate": "Bearer"})

    return check


def token_matches(token: str | None, authorization: str | None) -> bool:
    """`authorization` is `Bearer <token>`; never true when no token is configured."""
    scheme, _, given = (authorization or "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                             (token or "").encode())


def refusal(token: str | None) -> str:
    """Why a mutating call without the right token is refused."""
    return ("missing or wrong bearer token" if token else
            "DFCA_API_TOKEN is not set on the server: mutating calls are refused")


MAX_BODY_BYTES = 1 << 20  # a config is a few KB; nothing the API takes comes near this
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Reads that stay open under a read token: probes, Prometheus, the API's description, the dashboard's page and
# files (its data calls carry the token the user entered).
OPEN_PATHS = frozenset({"/livez", "/readyz", "/metrics", "/openapi.json", "/docs", "/ui"})
OPEN_PREFIXES = ("/ui/static/",)


def read_allowed(read_token: str | None, api_token: str | None, path: str, authorization: str | None,
                 query: str) -> bool:
    """A read goes through: no token configured at all, an open path, or the read or the API token given."""
    if not (read_token or api_token) or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return True
    given = [authorization] + [f"Bearer {unquote_plus(v)}" for k, _, v in (p.partition("=") for p in query.split("&"))
                               if k == "access_token"]
    return any(token_matches(t, g) for t in (read_token, api_token) for g in given)


class RequestGuard:
    """ASGI middleware in front of every route: a mutating request is refused before its body is read when its
    bearer token is wrong (401; with `token` None the routes decide), and any body above `max_body` bytes is
    refused with 413, whether it declares its length or streams it in chunks."""

    def __init__(self, app: ASGIApp, token: str | None = None, check_token: bool = False,
                 max_body: int = MAX_BODY_BYTES, read_token: str | None = None) -> None:
        self.app, self.token, self.check_token, self.max_body = app, token, check_token, max_body
        self.read_token = read_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.check_token and scope["method"] in MUTATING and not token_matches(self.token,
                                                                                headers.get("authorization")):
            await JSONResponse({"detail": refusal(self.token)}, 401,
                               headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if scope["method"] not in MUTATING and not read_allowed(
                self.read_token, self.token, scope["path"], headers.get("authorization"),
                scope.get("query_string", b"").decode("latin-1")):
            await JSONResponse({"detail": "missing or wrong bearer token: reads need the read token "
                                "(DFCA_READ_TOKEN) or the API token"}, 401,
                               headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:  # read (at most max_body + one chunk of) the body here, then hand it on
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            body.extend(message.get("body", b""))
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._too_large(scope, receive, send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"detail": f"request body above {self.max_body} bytes"}, 413)(scope, receive, send)


def add_validation_errors(app: FastAPI) -> None:
    """422 for a body that fails validation, naming each field, with the offending input as text: FastAPI's own
    handler echoes it as JSON and fails with 500 on NaN or infinity, which JSON cannot carry."""

    @app.exception_handler(RequestValidationError)
    async def refused(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", "")),
                   **({"input": repr(e["input"])[:200]} if "input" in e else {})} for e in err.errors()]
        return JSONResponse({"detail": errors}, 422)


def tls_files() -> tuple[str, str] | None:
    """(certificate, key) from DFCA_TLS_CERT and DFCA_TLS_KEY: the service answers HTTPS only. Both or neither."""
    cert, key = env("DFCA_TLS_CERT") or "", env("DFCA_TLS_KEY") or ""
    if bool(cert) != bool(key):
        raise ValueError("set both DFCA_TLS_CERT and DFCA_TLS_KEY (PEM files), or neither")
    return (cert, key) if cert else None


def server_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings: HTTPS when `tls_files()` names a certificate and its key."""
    tls = tls_files()
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                          ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)


def serve(app: FastAPI, host: str, port: int) -> None:
    """Run the app until SIGTERM/SIGINT; logs go through the root logger (see structured_logs)."""
    uvicorn.Server(server_config(app, host, port)).run()
