"""The router's responder (serving/responder.py): each stream's responses leave in the order they were made, from
its own thread; those that queued up behind one another leave as one (texts joined, metrics summed); an error is
never merged; a failing send does not stop the others; what was queued before `finish` is sent before the thread
ends; what Triton may still use is kept from the send on."""

from __future__ import annotations

import threading

from tokenrouter.serving.responder import Chunk, Responder

FINAL = 1


class FakeSender:
    def __init__(self, log: list, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.log, self.fail, self.gate = log, fail, gate
        self.entered = threading.Event()  # a send began

    def send(self, response: object, flags: int = 0) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the client went away")
        self.log.append((self, response, flags, threading.current_thread().name))


def build(chunk: Chunk) -> tuple:
    return (chunk.error or chunk.text), FINAL if chunk.final else 0, [f"tensor of {chunk.text!r}"]


def test_in_order_from_its_own_thread() -> None:
    log: list = []
    kept: list = []
    responder = Responder(build, keep=lambda *objects: kept.append(objects))
    a, b, gone = FakeSender(log), FakeSender(log), FakeSender(log, fail=True)
    for i in range(200):
        responder.send(a if i % 2 else b, Chunk(text=b"%d," % i))
        if i == 50:
            responder.send(gone, Chunk(text=b"lost", final=True))  # fails: the next ones still go
    responder.send(a, Chunk(text=b"end", final=True, keep=("request",)))
    responder.finish()
    assert responder.join(10)
    assert all(x[3] == "tr-router-responses" for x in log)
    # each stream's text, whole and in order, however its chunks were merged; its final response last
    text = {s: b"".join(x[1] for x in log if x[0] is s) for s in (a, b)}
    assert text[a] == b"".join(b"%d," % i for i in range(1, 200, 2)) + b"end"
    assert text[b] == b"".join(b"%d," % i for i in range(0, 200, 2))
    assert [x[2] for x in log if x[0] is a][-1] == FINAL and {x[2] for x in log if x[0] is b} == {0}
    # the sender, the response, its tensors and what was queued with it, kept once sent (the failed send's too)
    assert sum(1 for k in kept if k[0] is gone) == 1
    assert [k[-1] for k in kept if k[0] is a][-1] == "request"
    assert len(kept) == len(log) + 1


def test_a_streams_queued_chunks_leave_as_one() -> None:
    log: list = []
    observed: list[Chunk] = []
    gate = threading.Event()
    responder = Responder(build, observe=observed.append)
    slow, a, b = FakeSender(log, gate=gate), FakeSender(log), FakeSender(log)
    responder.send(slow, Chunk(text=b"x"))
    assert slow.entered.wait(10)  # the thread waits in this send while the rest queue up
    responder.send(a, Chunk(text=b"A1", ttft_s=0.5))
    responder.send(b, Chunk(text=b"B1", itl_s=[0.2]))
    responder.send(a, Chunk(text=b"", itl_s=[0.1]))  # held-back text: its metrics only
    responder.send(a, Chunk(text=b"A2", itl_s=[0.3]))
    responder.send(b, Chunk(error="boom", final=True, finished="error"))  # never merged: B1 goes first
    responder.send(a, Chunk(text=b"A3", final=True, finished="length", extras={"n": 4}, keep=("request",)))
    gate.set()
    responder.finish()
    assert responder.join(10)
    assert log[0][:3] == (slow, b"x", 0)
    # (each stream in its order; streams beside each other in any order)
    assert [x[1:3] for x in log if x[0] is a] == [(b"A1A2A3", FINAL)]
    assert [x[1:3] for x in log if x[0] is b] == [(b"B1", 0), ("boom", FINAL)]
    merged = next(c for c in observed if c.text == b"A1A2A3")
    assert merged.ttft_s == 0.5 and merged.itl_s == [0.1, 0.3]  # each gap its own, not their mean
    assert merged.finished == "length" and merged.extras == {"n": 4} and merged.keep == ("request",)
    assert [c.finished for c in observed if c.error] == ["error"]


def test_a_chunk_with_nothing_to_send_settles_its_metrics() -> None:
    log: list = []
    observed: list[Chunk] = []
    responder = Responder(build, observe=observed.append)
    responder.send(FakeSender(log), Chunk(ttft_s=0.25))
    responder.finish()
    assert responder.join(10)
    assert log == [] and [c.ttft_s for c in observed] == [0.25]


def test_finish_sends_what_is_queued_first() -> None:
    log: list = []
    gate = threading.Event()
    responder = Responder(build)
    slow = FakeSender(log, gate=gate)
    responder.send(slow, Chunk(text=b"0"))
    assert slow.entered.wait(10)
    for i in range(1, 5):
        responder.send(slow, Chunk(text=b"%d" % i))
    responder.finish()
    assert not responder.join(0.2)  # the first send is still waiting: nothing is dropped, the thread goes on
    gate.set()
    assert responder.join(10)
    assert [x[1] for x in log] == [b"0", b"1234"]  # what queued behind the first send left as one


def test_a_final_response_that_cannot_be_made_is_sent_as_an_error() -> None:
    log: list = []
    kept: list = []

    def fragile(chunk: Chunk) -> tuple:
        if chunk.text.endswith(b"bad"):
            raise ValueError("cannot build")
        return build(chunk)

    gate = threading.Event()
    responder = Responder(fragile, keep=lambda *objects: kept.append(objects))
    slow, a = FakeSender(log, gate=gate), FakeSender(log)
    responder.send(slow, Chunk(text=b"x"))
    assert slow.entered.wait(10)
    responder.send(a, Chunk(text=b"A1"))
    responder.send(a, Chunk(text=b"bad", final=True, keep=("request",)))  # merged with A1, then cannot be made
    gate.set()
    responder.finish()
    assert responder.join(10)
    finals = [x for x in log if x[0] is a]
    assert len(finals) == 1 and finals[0][2] == FINAL
    assert finals[0][1] == "the router could not make this response: ValueError: cannot build"
    assert [k[-1] for k in kept if k[0] is a] == ["request"]  # the request it ends, kept from the send on


def test_absorb_keeps_a_final_chunk_final() -> None:
    final = Chunk(text=b"a", final=True, finished="length", extras={"n": 1})
    final.absorb(Chunk(text=b"b"))
    assert final.final and final.finished == "length" and final.extras == {"n": 1} and final.text == b"ab"


def test_a_failing_build_or_observe_loses_only_that_response() -> None:
    log: list = []

    def fragile(chunk: Chunk) -> tuple:
        if chunk.text == b"bad":
            raise ValueError("cannot build")
        return build(chunk)

    def observe(chunk: Chunk) -> None:
        if chunk.ttft_s is not None:
            raise RuntimeError("metrics down")

    gate = threading.Event()
    responder = Responder(fragile, observe=observe)
    a, b, c = FakeSender(log, gate=gate), FakeSender(log), FakeSender(log)
    responder.send(a, Chunk(text=b"first"))
    assert a.entered.wait(10)
    responder.send(b, Chunk(text=b"bad"))
    responder.send(c, Chunk(text=b"ok", ttft_s=0.1))
    gate.set()
    responder.finish()
    assert responder.join(10)
    assert [x[1] for x in log] == [b"first", b"ok"]
