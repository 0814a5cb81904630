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

The buffers of channels nobody receives on any more are dropped. channels_redis receives
every process-local channel through one Redis key and buffers each message for its
channel until a receive() on that channel takes it: a message for a socket that has just
closed (its user's `wf.access`, sent as it closed) was kept for the life of the process,
and so was the empty buffer of every receive cancelled while it popped (each closing
socket's, about one in three). A dashboard opened and closed all day grew the process.
Now a channel's buffer goes when its last receive ends with it empty, and one that no
receive has waited on for `expiry` seconds (Redis would have dropped its messages by
then) goes with what it holds (see sweep()).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Any

from channels_redis.core import BoundedQueue, ChannelLock
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


class Buffers(collections.defaultdict[str, BoundedQueue]):
    """channels_redis's receive buffers (channel -> queue), noting when one is made for a
    channel no receive waits on: a message popped for it by another channel's receive."""

    def __init__(self, layer: RedisChannelLayer) -> None:
        super().__init__(functools.partial(BoundedQueue, layer.capacity))
        self.layer = layer

    def __missing__(self, channel: str) -> BoundedQueue:
        if channel not in self.layer.receivers:
            self.layer.unreceived_since.setdefault(channel, self.layer.monotonic())
        return super().__missing__(channel)


class RedisChannelLayer(BaseRedisChannelLayer):
    brpop_timeout = 2
    SWEEP_SECONDS = 1.0  # buffers without a receiver are looked for at most this often
    monotonic = staticmethod(time.monotonic)  # tests control it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receive_clean_locks = CleanLocks()
        self.receivers: dict[str, int] = {}  # process-local channel -> receives waiting on it
        # channel -> since when its buffer has had no receive waiting on it
        self.unreceived_since: dict[str, float] = {}
        self.swept_at = -float("inf")
        self.receive_buffer = Buffers(self)

    async def receive(self, channel: str) -> Any:
        if "!" not in channel:
            return await super().receive(channel)
        self.receivers[channel] = self.receivers.get(channel, 0) + 1
        self.unreceived_since.pop(channel, None)
        try:
            return await super().receive(channel)
        finally:
            self.receivers[channel] -= 1
            if not self.receivers[channel]:
                del self.receivers[channel]
                buffer = self.receive_buffer.get(channel)
                if buffer is None or buffer.empty():
                    # A receive cancelled mid-pop leaves its channel's empty buffer behind.
                    self.receive_buffer.pop(channel, None)
                else:
                    self.unreceived_since[channel] = self.monotonic()
            self.sweep()

    def sweep(self) -> None:
        """Drop the buffers of channels no receive has waited on for `expiry` seconds:
        their consumers are gone (a closed socket, a stopped hub). Messages are popped
        for them by other channels' receives, which call this, at most once a
        SWEEP_SECONDS."""
        now = self.monotonic()
        if now - self.swept_at < self.SWEEP_SECONDS:
            return
        self.swept_at = now
        for channel in list(self.receive_buffer):
            if channel in self.receivers:
                continue
            since = self.unreceived_since.setdefault(channel, now)
            if now - since >= self.expiry:
                del self.receive_buffer[channel]
        for channel in list(self.unreceived_since):
            if channel not in self.receive_buffer:
                del self.unreceived_since[channel]

    async def _brpop_with_clean(self, index: int, channel: Any, timeout: float) -> Any:
        member = await super()._brpop_with_clean(index, channel, timeout)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        return member
