"""The `dfca` command: runs, the local stack (`dfca up`), and the client side of the runtime's REST APIs."""
