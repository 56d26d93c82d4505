"""The web dashboard at `/ui`, served by the metrics service: experiments, live curves, the communication graph with
its legend, a run's summary, config and download links, workers and message counters, and create/start/stop.

The page is static (HTML, JS and CSS in `dashboard_static/`, no CDN, no build step); its curves and graph are drawn
with Apache ECharts, vendored there (`echarts.min.js`, its licence and version in `VENDORED.md`). The graph colours a
node's fill by its assigned cluster matched to a true one (`clients_view`) and its ring by its true cluster, so a
right clustering reads as fill = ring whatever numbers the run gave its clusters. It reads the metrics service's
own routes and reaches the topology service through same-origin proxy routes under `/ui/api/topology/`, which pass
the user's `Authorization` header on, so the browser needs no CORS. A config is created from pasted YAML: the proxy
parses it and validates it with the one config schema, so the page shows the same field errors as `dfca validate`.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import httpx
import torch
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from dfca.algorithms import schedule_of
from dfca.config import ConfigError, parse_config
from dfca.core.label_matching import label_matching
from dfca.results.evaluation import clustering_scores
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.metrics.run_summary import final_evaluation, history, summary_of

STATIC = files("dfca.runtime.metrics") / "dashboard_static"
MEDIA = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".txt": "text/plain",
         ".md": "text/markdown"}
PROXY_TIMEOUT_S = 30.0
MAX_YAML_BYTES = 1_000_000


def add_dashboard(app: FastAPI, store: MetricsStore, topology_url: str | None) -> None:
    """Mount `/ui` (the page), `/ui/static/*`, the topology proxy and the latest per-client clusters on `app`."""

    @app.get("/ui", include_in_schema=False, response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/ui/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        suffix = name[name.rfind("."):] if "." in name else ""
        resource = STATIC / name
        if "/" in name or suffix not in MEDIA or not resource.is_file():
            raise HTTPException(404, f"no static file {name!r}")
        cache = {"Cache-Control": "public, max-age=86400"} if name.startswith("echarts") else {}  # 1 MB, versioned
        return Response(resource.read_bytes(), media_type=MEDIA[suffix], headers=cache)

    @app.get("/ui/api/overview/{experiment}")
    def overview(experiment: str) -> dict[str, Any]:
        """What the experiment page draws, in one call that answers 200 even before the metrics service has heard
        of the experiment (a 404 would be an error in the browser's console): the summary, the run's config, the
        evaluated rounds (each with its `phase`, `phase_round` and `phase_rounds`: run_summary.history), the
        schedule's seeding and training rounds, and every client's latest assigned and true cluster for the graph,
        its assigned cluster matched to a true one (`clients_view`)."""
        stored = store.experiment(experiment)
        if stored is None:
            return {"id": experiment, "known": False, "summary": None, "config": None, "schedule": None,
                    "history": [], "clients": clients_view({})}
        reports = store.reports(experiment)
        schedule = schedule_of(stored.config)
        rows = [h for h in history(stored, reports) if "test_accuracy" in h]
        return {"id": experiment, "known": True, "status": stored.status, "summary": summary_of(store, experiment),
                "config": stored.config.model_dump(mode="json"), "history": rows,
                "schedule": {"seeding_rounds": schedule.seeding_rounds, "rounds": stored.config.rounds},
                "clients": clients_view(final_evaluation(reports, set()))}

    @app.get("/ui/api/scores")
    def scores() -> dict[str, dict[str, Any]]:
        """Accuracy and ARI of every experiment the metrics service knows, for the list."""
        out = {}
        for experiment in store.experiment_ids():
            ev = final_evaluation(store.reports(experiment), set())
            if ev.get("clients"):
                out[experiment] = {"test_accuracy": sum(ev["test_accuracy"]) / len(ev["test_accuracy"]),
                                   **clustering_scores(torch.tensor(ev["assigned"]), torch.tensor(ev["true_cluster"]),
                                                       ari="cluster_ari")}
        return out

    @app.api_route("/ui/api/topology/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def topology(path: str, request: Request) -> Response:
        if not topology_url:
            raise HTTPException(503, "the metrics service does not know the topology service (DFCA_TOPOLOGY_URL)")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        if request.method == "POST" and path == "experiments":  # YAML from the page: validate, then send JSON
            body, headers = yaml_to_json(body), {**headers, "content-type": "application/json"}
        try:
            async with httpx.AsyncClient(base_url=topology_url, timeout=PROXY_TIMEOUT_S) as client:
                response = await client.request(request.method, f"/{path}", content=body or None, headers=headers)
        except httpx.TransportError as err:
            raise HTTPException(502, f"the topology service at {topology_url} is not reachable: {err}") from err
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type", "application/json"))


def clients_view(final: dict[str, list[Any]]) -> dict[str, Any]:
    """Clients, assigned and true clusters for the graph, and `matched_assigned`: each client's assigned cluster
    as the true cluster it is matched to (`matching`, assigned -> true: the Hungarian matching that the matched
    cluster accuracy scores), so a node's fill and ring share a colour exactly when the client is clustered right
    (every node at ARI 1). An assigned cluster left over (more populated than true clusters) gets a number after
    the true ones, its own colour. Without true labels `has_truth` is false and `matched_assigned` is the
    assigned cluster."""
    clients, assigned = list(final.get("clients", [])), [int(a) for a in final.get("assigned", [])]
    truth = [int(t) for t in final.get("true_cluster", [])]
    has_truth = bool(clients) and len(truth) == len(assigned) and all(t >= 0 for t in truth)
    matching: dict[int, int] = {}
    if has_truth:
        matching = label_matching(assigned, truth)
        spare = max(truth) + 1
        for cluster in sorted(set(assigned) - set(matching)):
            matching[cluster], spare = spare, spare + 1
    return {"clients": clients, "assigned": assigned, "true_cluster": truth if has_truth else [],
            "has_truth": has_truth, "matching": {str(a): t for a, t in sorted(matching.items())},
            "matched_assigned": [matching[a] for a in assigned] if has_truth else assigned}


def yaml_to_json(body: bytes) -> bytes:
    """A pasted YAML config as the JSON the topology service takes; 422 naming the field when it is invalid."""
    if len(body) > MAX_YAML_BYTES:
        raise HTTPException(413, f"a config of more than {MAX_YAML_BYTES} bytes")
    try:
        data = yaml.safe_load(body.decode("utf-8", errors="replace")) or {}
    except yaml.YAMLError as err:
        raise HTTPException(422, f"not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise HTTPException(422, "the config must be a mapping of keys (name, algorithm, data, ...)")
    try:
        cfg = parse_config(data)
    except ConfigError as err:
        raise HTTPException(422, str(err)) from err
    return JSONResponse(cfg.model_dump(mode="json")).body
