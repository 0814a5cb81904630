"""channels_redis's layer with two fixes, both about receives that are cancelled.

A cancelled receive() really stops. redis-py swallows a cancellation that lands while a
blocking BZPOPMIN is being read: the pop returns (usually empty) and channels_redis's
receive loop pops again, for ever. A cancelled consumer (a closed socket, a stopping
worker, the end of a test's event loop) then never finished. After each pop we check
whether this task was asked to stop and stop if so. A message popped meanwhile is safe:
channels_redis keeps it in the channel's backup queue and puts it back at the next
receive(). The pop blocks for 2 s rather than 5, so a cancelled receive ends within 2 s.

A receive cancelled while it waits for the cleaning of the message before it leaves no
lock behind (CleanLocks).
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels_redis.core import ChannelLock
from channels_redis.core import RedisChannelLayer as BaseRedisChannelLayer


class CleanLocks(ChannelLock):
    """channels_redis's per-channel locks of the backup cleaning, which drop a channel's
    lock once nobody holds or waits for it; an acquire that does not get the lock (its
    task cancelled while it waits) now counts itself out again.

    Every message popped is cleaned from its backup queue by a task that holds the lock
    of the channel's Redis key (one key for all the process-local channels of a layer).
    A receive cancelled while it waited for that task (a socket closing just after a
    message, more often on a loaded machine) left its count behind: the lock was never
    dropped, and an asyncio lock that once had a waiter belongs to that event loop. The
    next loop to wait for it (the next test's: the process's one layer serves every
    test's loop in turn) failed the receive with "... is bound to a different event loop".
    """

    async def acquire(self, channel: str) -> bool:
        try:
            return await super().acquire(channel)
        except BaseException:  # not acquired: cancelled, or the lock belongs to another loop
            self.wait_counts[channel] -= 1
            if self.wait_counts[channel] < 1:
                del self.locks[channel]
                del self.wait_counts[channel]
            raise


class RedisChannelLayer(BaseRedisChannelLayer):
    brpop_timeout = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receive_clean_locks = CleanLocks()

    async def _brpop_with_clean(self, index: int, channel: Any, timeout: float) -> Any:
        member = await super()._brpop_with_clean(index, channel, timeout)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        return member
