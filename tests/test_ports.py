"""Local jobs' ports: below the ephemeral range, distinct, claimed (ogrpo.launch.ports.free_ports)."""

from __future__ import annotations

import socket
from pathlib import Path

from ogrpo.launch import ports


def test_free_ports_are_below_the_ephemeral_range_distinct_and_claimed():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    got = ports.free_ports(6)
    try:
        assert len(set(got)) == 6 and all(1024 <= p < low for p in got), (got, low)
        # a second caller never gets a port the first still holds
        other = ports.free_ports(6, owner=1)  # pid 1 is alive: its claims hold
        try:
            assert not set(other) & set(got)
        finally:
            ports.release_ports(other)
        for p in got:  # free to bind now: nothing else listens there
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    finally:
        ports.release_ports(got)
    assert not any((ports.LOCK_DIR / f"{p}.lock").exists() for p in got)


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "_below_ephemeral", lambda: range(taken, taken + 1))
        try:
            ports.free_ports(1)
        except OSError as exc:
            assert "could not reserve 1 free ports" in str(exc)
        else:
            raise AssertionError("a listening port was handed out")
