"""The control channel's receive: what arrived is read before silence is judged."""

from __future__ import annotations

import time

import pytest

from appliance.distributed import control
from appliance.distributed.control import ChannelClosed


def test_what_arrived_is_read_even_when_the_reader_ran_late() -> None:
    server = control.listen("127.0.0.1", 0)
    a = control.connect("127.0.0.1", server.getsockname()[1])
    b = control.accept(server, 5.0)
    assert b is not None
    try:
        a.send({"ping": 1.0})
        time.sleep(0.2)  # the reader was busy: its time is up when it comes to read
        assert b.receive(0.0) == {"ping": 1.0}
        with pytest.raises(ChannelClosed, match="no word for 0.1 s"):
            b.receive(0.1)
        a.close()
        with pytest.raises(ChannelClosed, match="connection closed"):
            b.receive(5.0)
    finally:
        a.close()
        b.close()
        server.close()
