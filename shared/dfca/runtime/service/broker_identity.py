"""Who a service is on the broker, said once at start: a shared broker user is a warning, never silent."""

from __future__ import annotations

import logging
from urllib.parse import unquote, urlsplit

from dfca.identity.principals import principal_of_user

log = logging.getLogger(__name__)


def warn_if_shared_user(broker_url: str, service: str) -> bool:
    """Log a warning when `broker_url`'s user is no principal's (a shared user: receivers cannot tell publishers
    apart, and any process holding it can forge control commands and any worker's models). True when it is shared."""
    if broker_url.startswith("memory://"):
        return False
    user = unquote(urlsplit(broker_url).username or "")
    if principal_of_user(user) is not None:
        return False
    log.warning("%s connects to the broker as the shared user %r, not as a principal's own user: every process "
                "holding it can forge control commands, events and any worker's models, and nothing can tell who "
                "published what (give each process its own user: dfca.identity.broker_users; `dfca up` does by "
                "default)", service, user, extra={"broker_user": user})
    return True
