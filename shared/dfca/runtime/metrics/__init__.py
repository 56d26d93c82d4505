"""The metrics service: its store, run summaries, Prometheus export, final results and the dashboard."""
