"""The aggregator process: an algorithm's central roles (its server side) over the message driver."""
