"""channels' in-memory layer with its expiry sweep run at most once a second.

The stock layer walks every channel and every group membership on each send, receive
and group_send to drop expired messages and memberships. A dashboard socket owns a
channel and belongs to its session's and its user's groups, so with hundreds of sockets
open every message the engine publishes paid for a walk over all of them. Messages
expire after a minute and memberships after a day: sweeping once a second keeps both.
"""

from __future__ import annotations

import time

from channels.layers import InMemoryChannelLayer as BaseInMemoryChannelLayer

SWEEP_SECONDS = 1.0


class InMemoryChannelLayer(BaseInMemoryChannelLayer):
    swept_at = 0.0

    def _clean_expired(self) -> None:
        now = time.monotonic()
        if now - self.swept_at < SWEEP_SECONDS:
            return
        self.swept_at = now
        super()._clean_expired()
