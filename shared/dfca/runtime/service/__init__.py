"""What every service process shares: HTTP health and auth, JSON logs, event queues, registration."""
