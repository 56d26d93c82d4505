"""Consume JSON documents from one queue: valid ones go to a handler; invalid ones, and ones not published by the
principal they must come from (where the broker proves publishers: dfca.identity.principals), to the dead-letter
exchange."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dfca.identity.principals import PublisherCheck
from dfca.runtime.protocol.messages import MessageInvalid
from dfca.transport import Message, Transport

log = logging.getLogger(__name__)


class QueueConsumer:
    """Pull-style: call `poll` from one thread (or `run_forever` on a thread of its own)."""

    def __init__(self, transport: Transport, queue: str, decode: Callable[[bytes], Any],
                 handle: Callable[[Any], None], principal: Callable[[Any], str],
                 handle_many: Callable[[list[Any]], list[Exception | None]] | None = None,
                 batch: int = 1, linger: float = 0.0) -> None:
        """`principal(document)`: the principal that may publish `document`. `handle_many(documents)`, with `batch`
        > 1: up to `batch` documents that are there at once, handled together (one store transaction), returning
        each one's refusal or None; if it raises, each is handled again on its own by `handle`. `linger`: after a
        message, wait this long for the next one before handling a batch that is not full (documents that come a
        few ms apart, as a round's reports of several workers do, then share a transaction)."""
        self.transport, self.queue, self.decode, self.handle = transport, queue, decode, handle
        self.principal = principal
        self.handle_many, self.batch = handle_many, batch if handle_many is not None else 1
        self.linger = linger if self.batch > 1 else 0.0
        self.publishers = PublisherCheck(transport.user)
        self.rejected = 0
        self.forged = 0  # of the rejected: published by another principal than the document's own
        self.handled = 0

    def poll(self, timeout: float) -> int:
        """Handle every message that is there (waiting up to `timeout` for the first); returns how many."""
        count = 0
        wait = timeout
        taken: list[tuple[Message, Any]] = []
        while (message := self.transport.receive(self.queue, wait)) is not None:
            wait = self.linger
            count += 1
            if (document := self._checked(message)) is not None:
                taken.append((message, document))
            if len(taken) >= self.batch:
                self._handle(taken)
                taken = []
        if taken:
            self._handle(taken)
        return count

    def _checked(self, message: Message) -> Any | None:
        """The message's document, or None: it did not decode, or came from another principal (dead-lettered)."""
        try:
            document = self.decode(message.body)
        except MessageInvalid as err:
            self.rejected += 1
            log.warning("dead-lettering an invalid message from %s (%s): %s", self.queue, message.routing_key,
                        str(err)[:200])
            self.transport.reject(message, requeue=False)
            return None
        if not self.publishers.allows(message.publisher, principal := self.principal(document)):
            self.rejected += 1
            self.forged += 1
            log.warning("dead-lettering a %s from %s published by %r: only %s may publish it",
                        type(document).__name__, self.queue, message.publisher, principal)
            self.transport.reject(message, requeue=False)
            return None
        return document

    def _handle(self, taken: list[tuple[Message, Any]]) -> None:
        if len(taken) > 1 and self.handle_many is not None:
            try:
                refusals = self.handle_many([document for _, document in taken])
            except Exception:  # handled again one by one: the one that cannot be stored is set aside alone
                log.warning("handling %d messages from %s together failed; handling them one by one", len(taken),
                            self.queue, exc_info=True)
            else:
                for (message, _), refusal in zip(taken, refusals, strict=True):
                    self._settle(message, refusal)
                return
        for message, document in taken:
            try:
                self.handle(document)
            except Exception as err:  # a document that passed decoding and still cannot be stored: set it aside
                self._settle(message, err)
            else:
                self._settle(message, None)

    def _settle(self, message: Message, refusal: Exception | None) -> None:
        if refusal is None:
            self.transport.ack(message)
            self.handled += 1
            return
        self.rejected += 1
        log.error("dead-lettering a message from %s (%s) its handler could not take", self.queue, message.routing_key,
                  exc_info=refusal)
        self.transport.reject(message, requeue=False)

    def run_forever(self, stop: threading.Event, timeout: float = 0.5) -> None:
        while not stop.is_set():
            try:
                self.poll(timeout)
            except Exception:  # the transport reconnects by itself; a handler bug must not end the thread
                log.exception("consumer of %s failed; retrying", self.queue)
                stop.wait(1.0)
