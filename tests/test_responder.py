"""The router's responder (serving/responder.py): responses and calls leave in the order they were queued, from
its own thread; a failing send or call does not stop the others; what was queued before `finish` is sent before
the thread ends; what Triton may still use is kept from the send on."""

from __future__ import annotations

import threading

from tokenrouter.serving.responder import Responder


class FakeSender:
    def __init__(self, log: list, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.log, self.fail, self.gate = log, fail, gate

    def send(self, response: object, flags: int = 0) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the client went away")
        self.log.append((self, response, flags, threading.current_thread().name))


def test_in_order_from_its_own_thread() -> None:
    log: list = []
    kept: list = []
    responder = Responder(lambda *objects: kept.append(objects))
    a, b, gone = FakeSender(log), FakeSender(log), FakeSender(log, fail=True)
    for i in range(200):
        responder.send(a if i % 2 else b, i, 0, f"tensors {i}")
        if i == 50:
            responder.send(gone, "lost", 2)  # fails: the next ones still go
            responder.call(lambda: 1 / 0)
        if i % 10 == 0:
            responder.call(lambda i=i: log.append(("call", i)))
    responder.send(a, "final", 2, "tensors", "request")
    responder.finish()
    assert responder.join(10)
    sends = [x for x in log if x[0] != "call"]
    assert [x[1] for x in sends] == [*range(200), "final"]
    assert all(x[3] == "tr-router-responses" for x in sends)
    assert sends[-1][2] == 2
    # each call ran after the responses queued before it, before those queued after it
    order = [x[1] if x[0] != "call" else ("call", x[1]) for x in log]
    for i in range(0, 200, 10):
        assert order.index(("call", i)) == order.index(i) + 1
    # the sender, the response and what was queued with it, kept once sent (the failed send's too)
    assert len(kept) == 202 and kept[0] == (b, 0, "tensors 0") and kept[-1] == (a, "final", "tensors", "request")


def test_finish_sends_what_is_queued_first() -> None:
    log: list = []
    gate = threading.Event()
    responder = Responder()
    slow = FakeSender(log, gate=gate)
    for i in range(5):
        responder.send(slow, i, 0)
    responder.finish()
    assert not responder.join(0.2)  # the first send is still waiting: nothing is dropped, the thread goes on
    gate.set()
    assert responder.join(10)
    assert [x[1] for x in log] == [0, 1, 2, 3, 4]
