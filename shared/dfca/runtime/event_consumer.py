"""Consume JSON documents from one queue: valid ones go to a handler; invalid ones, and ones not published by the
principal they must come from (where the broker proves publishers: dfca.principals), to the dead-letter exchange."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dfca.principals import PublisherCheck
from dfca.runtime.messages import MessageInvalid
from dfca.transport import Transport

log = logging.getLogger(__name__)


class QueueConsumer:
    """Pull-style: call `poll` from one thread (or `run_forever` on a thread of its own)."""

    def __init__(self, transport: Transport, queue: str, decode: Callable[[bytes], Any],
                 handle: Callable[[Any], None], principal: Callable[[Any], str]) -> None:
        """`principal(document)`: the principal that may publish `document`."""
        self.transport, self.queue, self.decode, self.handle = transport, queue, decode, handle
        self.principal = principal
        self.publishers = PublisherCheck(transport.user)
        self.rejected = 0
        self.forged = 0  # of the rejected: published by another principal than the document's own
        self.handled = 0

    def poll(self, timeout: float) -> int:
        """Handle every message that is there (waiting up to `timeout` for the first); returns how many."""
        count = 0
        wait = timeout
        while (message := self.transport.receive(self.queue, wait)) is not None:
            wait = 0.0
            count += 1
            try:
                document = self.decode(message.body)
            except MessageInvalid as err:
                self.rejected += 1
                log.warning("dead-lettering an invalid message from %s (%s): %s", self.queue, message.routing_key,
                            str(err)[:200])
                self.transport.reject(message, requeue=False)
                continue
            if not self.publishers.allows(message.publisher, principal := self.principal(document)):
                self.rejected += 1
                self.forged += 1
                log.warning("dead-lettering a %s from %s published by %r: only %s may publish it",
                            type(document).__name__, self.queue, message.publisher, principal)
                self.transport.reject(message, requeue=False)
                continue
            try:
                self.handle(document)
            except Exception:  # a document that passed decoding and still cannot be stored: set it aside
                self.rejected += 1
                log.exception("dead-lettering a message from %s (%s) its handler could not take", self.queue,
                              message.routing_key)
                self.transport.reject(message, requeue=False)
                continue
            self.transport.ack(message)
            self.handled += 1
        return count

    def run_forever(self, stop: threading.Event, timeout: float = 0.5) -> None:
        while not stop.is_set():
            try:
                self.poll(timeout)
            except Exception:  # the transport reconnects by itself; a handler bug must not end the thread
                log.exception("consumer of %s failed; retrying", self.queue)
                stop.wait(1.0)
