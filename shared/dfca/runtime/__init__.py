"""The distributed runtime, a folder for each process it runs in (the services in `services/` wire these to a broker
and HTTP):

- `driver/`: driver 2, the message driver, in every worker and in the aggregator: the pump (`message_driver`) and its
  parts (`hearing`, `admission`, `ledger`, `folding`, `outbox`, `decoding`, `bindings`, `delivery`, `liveness`,
  `checkpoints`, `driver_stats`), and `host_transport`, the transport a worker's driver talks through;
- `worker/`: a worker process: `worker_agent` (its control queue, heartbeats, runners) and `client_runner` (one
  experiment's round loop, checkpoints and resume);
- `aggregator/`: the aggregator process: `central_roles` (an algorithm's server side);
- `control/`: the topology service: `coordinator` (experiments, graphs, what workers are told) and `experiments`
  (an experiment's record and the rules that move it along);
- `metrics/`: the metrics service: `metrics_store`, `run_summary`, `prometheus_export`, `experiment_results`, and the
  dashboard (`dashboard`, `dashboard_static/`);
- `service/`: what every service process has: `http_service` (health, auth, uvicorn), `structured_logs`,
  `event_consumer` (JSON documents from a queue), `registration` (does the topology service know this process);
- `protocol/`: what the processes say to each other: `messages` (commands and events, pydantic JSON, never pickle)
  and `final_models` (a worker's share of the final models).

`dfca up` (the whole stack as supervised processes on one machine) is the command's: dfca.cli.launcher.
"""
