"""Who is who on the broker: routing keys and queues, principals, their AMQP users, and which worker hosts a client."""
