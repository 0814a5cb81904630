"""Odd client frames on the dashboard sockets, through the real ASGI stack and channel
layer: each gets an `error` frame and the socket goes on answering."""

from __future__ import annotations

import json

import pytest

from .test_consumers import RECEIVE_TIMEOUT, connect, receive_until, staff_cookie

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("path", ["/ws/overview/", "/ws/instances/"])
@pytest.mark.parametrize("kind", [["ping"], {"ping": 1}, 1])
async def test_a_type_that_is_not_a_string_gets_an_error_frame_and_the_socket_lives(path, kind):
    """A list or an object as "type" is unhashable: the lookup in the accepted types
    raised, and the consumer died instead of answering."""
    communicator, connected = await connect(path, await staff_cookie())
    assert connected
    await receive_until(communicator, "snapshot")
    await communicator.send_to(text_data=json.dumps({"type": kind}))
    error = await communicator.receive_json_from(timeout=RECEIVE_TIMEOUT)
    assert error["type"] == "error" and "unknown message" in error["error"]
    await communicator.send_json_to({"type": "ping"})
    assert (await receive_until(communicator, "pong"))["type"] == "pong"
    await communicator.disconnect()
