"""An operation's record (trace.OpRecord) is the compiled one (_recordcore.c) wherever it
builds, else trace.py's own class: the two start alike, make their argument text alike (once,
when first read), read back what is written, print alike and refuse what the other refuses."""

from __future__ import annotations

import math
import time

import pytest

from anyccl import _recordcore, trace

KINDS = {"python": trace._OpRecord, "compiled": _recordcore.OpRecord}
FIELDS = ("name", "seq", "nbytes", "_args", "agree", "deadline", "state", "started_at",
          "ended_at", "error", "replayed")


def test_the_install_builds_the_compiled_record_and_trace_uses_it():
    """README's `pip install -e .` builds it (as it builds the shm core)."""
    assert trace.OpRecord is _recordcore.OpRecord


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_starts_queued_with_no_deadline_issued_now(kind):
    before = time.monotonic()
    record = KINDS[kind]("all_reduce", 7, "float32 x 4", 16)
    after = time.monotonic()
    assert before <= record.issued_at <= after
    assert (record.name, record.seq, record.nbytes, record.args) == \
        ("all_reduce", 7, 16, "float32 x 4")
    assert record.agree is None and math.isinf(record.deadline) and record.deadline > 0
    assert record.state == "queued" and record.replayed is False
    assert record.started_at is None and record.ended_at is None and record.error is None
    bare = KINDS[kind]("barrier", 1)
    assert (bare.args, bare.nbytes) == ("", 0)


def test_both_kinds_start_alike_and_read_back_what_is_written():
    made = {kind: cls("send", 3, "dst=1, tag=0, 8 B", 8) for kind, cls in KINDS.items()}
    python, compiled = ({f: getattr(r, f) for f in FIELDS} for r in made.values())
    assert python == compiled
    values = {"name": "recv", "seq": 9, "nbytes": 4096, "agree": (1, 2), "deadline": 12.5,
              "state": "failed", "started_at": 1.25, "ended_at": 2.5,
              "error": "PeerLostError: rank 1", "replayed": True, "issued_at": 0.75}
    for record in made.values():
        for field, value in values.items():
            setattr(record, field, value)
        assert {f: getattr(record, f) for f in values} == values
        assert str(record) == "recv(dst=1, tag=0, 8 B) #9"
        assert repr(record) == "OpRecord(recv(dst=1, tag=0, 8 B) #9)"


@pytest.mark.parametrize("kind", KINDS)
def test_argument_text_given_as_a_call_is_made_once_when_first_read(kind):
    calls = []

    def text(peer: int, nbytes: int) -> str:
        calls.append((peer, nbytes))
        return f"src={peer}, {nbytes} B"

    record = KINDS[kind]("recv", 2, (text, 1, 8), 8)
    assert calls == []
    assert str(record) == "recv(src=1, 8 B) #2" and record.args == "src=1, 8 B"
    assert record._args == "src=1, 8 B" and calls == [(1, 8)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_refuses_other_attributes_and_wrong_arguments(kind):
    record = KINDS[kind]("send", 1)
    with pytest.raises(AttributeError):
        record.colour = "red"
    with pytest.raises(TypeError):
        KINDS[kind]("send")
    with pytest.raises(TypeError):
        KINDS[kind]("send", 1, "", 0, "extra")
