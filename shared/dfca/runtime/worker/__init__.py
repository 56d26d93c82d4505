"""A worker process: its agent (control queue, heartbeats) and one client runner per experiment."""
