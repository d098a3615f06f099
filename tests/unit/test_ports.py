"""Test servers get ports the kernel never hands out on its own (raylastic.testing.ports)."""

import socket

from raylastic.testing.ports import ephemeral_range, free_port, free_ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    lo, hi = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for p in ports:
        assert not lo <= p <= hi, (p, lo, hi)  # no outgoing connection takes it meanwhile
        assert not 10002 <= p <= 19999, p  # nor a Ray worker
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch):
    """The random pick lands on a port someone listens on first: the next one is taken."""
    from raylastic.testing import ports

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken, taken + 1])

        class Rng:
            def choice(self, spans):
                return spans[0]

            def randint(self, a, b):
                return next(picks)

        monkeypatch.setattr(ports.random, "Random", Rng)
        assert ports.free_ports(1) == [taken + 1]
