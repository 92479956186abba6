"""The network lab: hosts with their own addresses reach each other (and only each other), a
partition cuts a host off until healed, the relay adds its delay to every round trip, and the lab
is torn down on exit, on SIGTERM, and (for a SIGKILLed owner) by the next lab."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stallfree.testing.netlab import PREFIX, NetLab, remove_leftovers, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

PY = sys.executable

ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
    print("ready", flush=True)
    while True:
        c, peer = s.accept()
        data = c.recv(100)
        c.sendall(data + b" from " + peer[0].encode())
        c.close()
    """
)

# prints "OK <reply> <seconds>" or "FAIL <error>"; the round trips are timed, never asserted fast
ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    t = time.monotonic()
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
        c.sendall(b"ping")
        reply = c.recv(100).decode()
        print("OK", reply.replace(" ", "_"), time.monotonic() - t)
    except OSError as exc:
        print("FAIL", type(exc).__name__)
    """
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split(" ")[0] for line in out.splitlines() if line.startswith(PREFIX)}


def _echo(lab: NetLab, host: str, port: int) -> subprocess.Popen:
    server = lab.popen(
        host, [PY, "-c", ECHO_SERVER, lab.hosts[host].address, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline().strip() == "ready"
    return server


def _ask(lab: NetLab, host: str, address: str, port: int, timeout: float = 2.0) -> list[str]:
    done = lab.run(
        host, [PY, "-c", ECHO_CLIENT, address, str(port), str(timeout)], capture_output=True, text=True
    )
    return done.stdout.split()


def test_hosts_have_their_own_addresses_and_reach_each_other_only_there():
    with NetLab(nodes=2) as lab:
        assert [h.address for h in lab.nodes] == ["10.213.0.10", "10.213.0.11"]
        assert lab.storage.address == "10.213.0.1"
        _echo(lab, "node1", 7000)
        reply = _ask(lab, "node0", "10.213.0.11", 7000)
        assert reply[:2] == ["OK", "ping_from_10.213.0.10"]  # the peer saw node0's own address
        # node1's server is bound to node1's address: node1's loopback does not answer
        assert _ask(lab, "node1", "127.0.0.1", 7000)[0] == "FAIL"
        # the root namespace has no address on the lab's bridge, so it cannot reach the lab
        root = subprocess.run(
            [PY, "-c", ECHO_CLIENT, "10.213.0.11", "7000", "0.5"], capture_output=True, text=True, timeout=30
        )
        assert root.stdout.split()[0] == "FAIL"


def test_a_partition_cuts_a_host_off_until_healed():
    with NetLab(nodes=2, storage=False) as lab:
        _echo(lab, "node1", 7001)
        assert _ask(lab, "node0", "10.213.0.11", 7001)[0] == "OK"
        lab.partition("node1")
        assert _ask(lab, "node0", "10.213.0.11", 7001, timeout=1.0) == ["FAIL", "TimeoutError"]
        lab.heal("node1")
        deadline = time.monotonic() + 10
        while (reply := _ask(lab, "node0", "10.213.0.11", 7001))[0] != "OK" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reply[0] == "OK"


def test_the_relay_adds_its_delay_to_every_round_trip():
    """Connect (one round trip) plus one request (another): at least 4 one-way delays."""
    delay = 0.05
    with NetLab(nodes=1) as lab:
        _echo(lab, "storage", 7002)
        lab.relay("storage", 8002, to=(lab.storage.address, 7002), one_way_delay_s=delay)
        direct = _ask(lab, "node0", lab.storage.address, 7002)
        relayed = _ask(lab, "node0", lab.storage.address, 8002)
        assert direct[0] == relayed[0] == "OK"
        assert relayed[1] == "ping_from_10.213.0.1"  # the server sees the relay, in storage
        assert float(relayed[2]) >= 4 * delay  # a lower bound: the delay is injected, not measured


def test_close_removes_every_namespace_and_the_bridge():
    lab = NetLab(nodes=3).start()
    made = {h.netns for h in lab.hosts.values()}
    own = {ns.rsplit("-", 1)[0] + "-" for ns in made}.pop()  # sflab-PID-ID-: this lab's names
    assert made <= _namespaces()
    lab.close()
    lab.close()  # idempotent
    # only this lab's: other tests of the parallel pass start labs of their own meanwhile
    assert {ns for ns in _namespaces() if ns.startswith(own)} == set()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert lab.bridge not in links


OWNER = textwrap.dedent(
    """
    import json, sys, time
    from stallfree.testing.netlab import NetLab
    lab = NetLab(nodes=2).start()
    print(json.dumps(sorted(h.netns for h in lab.hosts.values())), flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_owner_leaves_nothing_behind(how):
    owner = subprocess.Popen([PY, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        made = set(json.loads(owner.stdout.readline()))
        assert made <= _namespaces()
        owner.send_signal(getattr(signal, how))
        assert owner.wait(30) == -getattr(signal, how)
    finally:
        if owner.poll() is None:
            owner.kill()
    if how == "SIGTERM":  # the lab's handler tore it down before the process died
        assert not made & _namespaces()
    else:  # nothing ran at death: the next lab (or remove_leftovers) finds the owner dead
        assert made <= _namespaces()
        removed = remove_leftovers()
        assert made <= set(removed)
        assert not made & _namespaces()
