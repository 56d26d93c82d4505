"""The message driver (driver 2) and its parts: runs in every worker process and in the aggregator."""
