"""The distributed runtime's shared parts: the services in `services/` only wire these to a broker and HTTP.

- `message_driver`: driver 2, any algorithm's rows over a transport: the pump that joins `hearing` (who
  hears whom), `admission` (sender's host, cut-off, future rounds), `ledger` (dedupe, hold, staleness,
  waiting, deadlines), `folding`, `outbox`, `decoding`, `bindings`, `delivery`, `checkpoints` and `driver_stats`;
- `messages`: control commands and metric events (pydantic JSON, never pickle);
- `sharding`: which worker hosts which clients;
- `host_transport`: the transport a worker's driver talks through (deferred acks, lag, stop);
- `liveness`: which senders a driver still waits for;
- `client_runner`: the round loop of one experiment on one worker, with checkpoints and resume;
- `worker_agent`: one worker process: its runners, control consumer and heartbeats;
- `coordinator` and `experiments`: the topology service's control plane and experiment records;
- `metrics_store`, `run_summary`, `prometheus_export`: the metrics service's storage and views;
- `central_roles`: the aggregator's central roles (an algorithm's server side);
- `launcher`: `dfca up`, the whole stack as supervised OS processes.
"""
