"""The test port allocator: ports below the ephemeral range, disjoint per process slice, pairs free together."""

from __future__ import annotations

import socket

import pytest

from hps_service.runtime import processes
from hps_service.runtime.processes import PAIR_OFFSET, PORT_BASE, PORT_SPAN, free_port, port_slice


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_and_their_pairs_lie_below_the_kernels_ephemeral_range() -> None:
    assert _ephemeral_low() > PORT_BASE + PORT_SPAN - 1 + PAIR_OFFSET


@pytest.mark.parametrize("index", [0, 1, 2])
def test_each_slice_hands_out_ports_only_from_its_own_share(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    monkeypatch.setenv("HPS_PORT_SLICE", f"{index}/3")
    monkeypatch.setattr(processes, "_cursor", {})
    width = PORT_SPAN // 3
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(PORT_BASE + index * width <= p < PORT_BASE + (index + 1) * width for p in ports)


def test_a_bound_port_is_skipped_and_a_pair_has_both_ports_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPS_PORT_SLICE", "0/1")
    monkeypatch.setattr(processes, "_cursor", {"0/1": 100})
    first = free_port()
    with socket.socket() as held, socket.socket() as held_pair:
        held.bind(("127.0.0.1", first))
        held_pair.bind(("127.0.0.1", first + 1 + PAIR_OFFSET))
        processes._cursor["0/1"] = first - PORT_BASE
        assert free_port(pair=True) not in (first, first + 1)
        processes._cursor["0/1"] = first - PORT_BASE
        assert free_port() == first + 1


@pytest.mark.parametrize("raw", ["1", "a/b", "2/2", "-1/2", "0/0"])
def test_a_malformed_slice_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("HPS_PORT_SLICE", raw)
    with pytest.raises(ValueError, match="HPS_PORT_SLICE"):
        port_slice()


def test_a_slice_with_no_free_port_left_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPS_PORT_SLICE", f"{PORT_SPAN - 1}/{PORT_SPAN}")  # a slice of one port
    monkeypatch.setattr(processes, "_cursor", {})
    only = PORT_BASE + PORT_SPAN - 1
    with socket.socket() as held:
        held.bind(("127.0.0.1", only))
        with pytest.raises(RuntimeError, match=f"no free port on 127.0.0.1 in {only}..{only}"):
            free_port()
