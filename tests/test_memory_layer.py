"""The in-memory channel layer of the embedded set-up (wfdash.memory_layer)."""

from __future__ import annotations

import asyncio

from channels.layers import InMemoryChannelLayer as StockLayer

from wfdash import memory_layer


def test_the_expiry_sweep_runs_once_a_second_not_per_message(monkeypatch):
    """Hundreds of sockets mean hundreds of channels and memberships: a walk over them
    all per published message made every message cost in proportion to open pages."""
    sweeps = []
    monkeypatch.setattr(StockLayer, "_clean_expired", lambda self: sweeps.append(1))
    now = [1000.0]
    monkeypatch.setattr(memory_layer.time, "monotonic", lambda: now[0])

    async def publish(layer, channel, times):
        for _ in range(times):
            await layer.group_send("instance.1", {"type": "wf.instance", "pk": 1})
            assert (await layer.receive(channel))["pk"] == 1

    async def scenario():
        layer = memory_layer.InMemoryChannelLayer()
        channel = await layer.new_channel()
        await layer.group_add("instance.1", channel)
        await publish(layer, channel, 50)
        assert len(sweeps) == 1
        now[0] += memory_layer.SWEEP_SECONDS
        await publish(layer, channel, 50)
        assert len(sweeps) == 2

    asyncio.run(scenario())


def test_expired_messages_and_their_channels_still_go(monkeypatch):
    async def scenario():
        layer = memory_layer.InMemoryChannelLayer(expiry=0)
        gone = await layer.new_channel()
        await layer.group_add("overview", gone)
        await layer.send(gone, {"type": "stale"})
        layer.swept_at = -float("inf")  # the next operation sweeps
        await layer.group_send("overview", {"type": "fresh"})
        assert gone not in layer.groups.get("overview", {})  # dropped with its expired message

    asyncio.run(scenario())
