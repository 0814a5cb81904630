"""channels_redis's layer with one fix: a cancelled receive() really stops.

redis-py swallows a cancellation that lands while a blocking BZPOPMIN is being read:
the pop returns (usually empty) and channels_redis's receive loop pops again, for
ever. A cancelled consumer (a closed socket, a stopping worker, the end of a test's
event loop) then never finished. After each pop we check whether this task was asked
to stop and stop if so. A message popped meanwhile is safe: channels_redis keeps it in
the channel's backup queue and puts it back at the next receive(). The pop blocks for
2 s rather than 5, so a cancelled receive ends within 2 s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels_redis.core import RedisChannelLayer as BaseRedisChannelLayer


class RedisChannelLayer(BaseRedisChannelLayer):
    brpop_timeout = 2

    async def _brpop_with_clean(self, index: int, channel: Any, timeout: float) -> Any:
        member = await super()._brpop_with_clean(index, channel, timeout)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        return member
