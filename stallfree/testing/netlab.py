"""Nodes with their own addresses on one machine: Linux network namespaces on a private bridge, for
tests and benchmarks of what crosses a network (cache servers per node, remote storage, rendezvous).

A ``NetLab(nodes=N)`` makes N node namespaces and one storage namespace, each with an ``eth0`` on
a bridge of its own and an address in ``SUBNET`` (``10.213.0.0/24``; storage is ``.1``, node ``i``
is ``.(10 + i)``), plus ``lo``. The root namespace gets no address on the bridge, so nothing in a
lab can reach the machine's real networks and nothing outside can reach the lab; every lab has its
own bridge, so two labs (two test processes) never see each other even with equal addresses.

- ``popen(host, argv)`` / ``run(host, argv)`` start a process inside a host (``ip netns exec``);
- ``partition(host)`` / ``heal(host)`` take a host's link down and up (100% loss both ways);
- ``relay(host, port, to=(address, port), one_way_delay_s=)`` starts a latency relay in ``host``:
  a TCP forwarder that holds every chunk for the delay in each direction, so each request pays a
  real round trip. Why a relay and not ``tc netem``: the kernels these tests run on (Firecracker
  guests among them) may have no ``sch_netem``; ``netem_available()`` tells, and ``delay()`` uses
  netem where it exists. The relay keeps order and pipelines (bandwidth is not limited).

Teardown always runs: on leaving the ``with`` block, at interpreter exit, and on SIGTERM (the
handler closes the lab, then exits as SIGTERM would). A lab killed with SIGKILL leaves its
namespaces behind; their names carry the owner's pid, and the next lab removes those whose owner
is dead. Needs root and iproute2: ``unavailable_reason()`` says why a lab cannot be made here
(tests skip with that reason).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "sflab"
SUBNET = "10.213.0"
STORAGE_HOST = 1
FIRST_NODE = 10
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-")


@dataclass(frozen=True)
class Host:
    """One namespace of a lab: its name in the lab (``node0``, ``storage``), the namespace, its
    address, and the bridge-side end of its link (what ``partition`` takes down)."""

    name: str
    netns: str
    address: str
    link: str


def unavailable_reason() -> str | None:
    """Why a lab cannot be made on this machine, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe-{threading.get_ident() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether the kernel has ``tc netem`` (a qdisc on a scratch namespace's loopback)."""
    if shutil.which("tc") is None or unavailable_reason() is not None:
        return False
    probe = f"{PREFIX}-{os.getpid()}-netem"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    try:
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
            ],
            capture_output=True,
        )
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces and links of labs whose owner process is gone; returns their names."""
    removed = []
    names = _ip("netns", "list", check=False).stdout.split("\n")
    for line in names:
        name = line.split(" ")[0]
        m = _NAME.match(name + "-")
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        m = re.match(r"^sl(\d+)[bv]", link)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


class NetLab:
    """``nodes`` node namespaces and a storage namespace on a private bridge; a context manager."""

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, nodes: int = 2, *, storage: bool = True) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"a lab has 1..200 nodes, not {nodes}")
        with NetLab._count_lock:
            NetLab._count += 1
            self._id = NetLab._count
        pid = os.getpid()
        # interface names have at most 15 characters: "sl" + pid + kind + lab + index
        self._tag = f"sl{pid}"
        self.bridge = f"{self._tag}b{self._id}"
        if len(f"{self._tag}v{self._id}x{FIRST_NODE + nodes}") > 15:
            raise RuntimeError(f"lab {self._id} of pid {pid}: interface names would pass 15 characters")
        hosts = [("storage", STORAGE_HOST)] if storage else []
        hosts += [(f"node{i}", FIRST_NODE + i) for i in range(nodes)]
        self.hosts: dict[str, Host] = {
            name: Host(
                name=name,
                netns=f"{PREFIX}-{pid}-{self._id}-{name}",
                address=f"{SUBNET}.{octet}",
                link=f"{self._tag}v{self._id}x{octet}",
            )
            for name, octet in hosts
        }
        self._processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._closed = False
        self._old_sigterm: Any = None

    # -- hosts ---------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Host]:
        return [h for n, h in self.hosts.items() if n.startswith("node")]

    @property
    def storage(self) -> Host:
        if "storage" not in self.hosts:
            raise ValueError("this lab was made without a storage namespace")
        return self.hosts["storage"]

    def host(self, name_or_host: str | Host) -> Host:
        return name_or_host if isinstance(name_or_host, Host) else self.hosts[name_or_host]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> NetLab:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        gone = remove_leftovers()
        if gone:
            log.info("removed %d leftovers of killed labs: %s", len(gone), ", ".join(gone))
        self._install_sigterm()
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts.values():
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
                _ip("link", "set", h.link, "master", self.bridge, "up")
                _ip("addr", "add", f"{h.address}/24", "dev", "eth0", netns=h.netns)
                _ip("link", "set", "eth0", "up", netns=h.netns)
                _ip("link", "set", "lo", "up", netns=h.netns)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process started in the lab, then delete its namespaces and bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in self._processes:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL) if _is_group_leader(p.pid) else p.kill()
        for p in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for h in self.hosts.values():
            if h.netns in self._made:
                _kill_namespace_processes(h.netns)
                _ip("netns", "del", h.netns, check=False)
        if self.bridge in self._made:
            _ip("link", "del", self.bridge, check=False)
        self._restore_sigterm()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; atexit and __exit__ still clean up
        self._old_sigterm = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self.close()
            previous = self._old_sigterm
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- processes -----------------------------------------------------------------------------
    def popen(self, host: str | Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace (its own process group); stopped by ``close``."""
        h = self.host(host)
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], **kwargs)
        self._processes.append(p)
        return p

    def run(
        self, host: str | Host, argv: Sequence[str], timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (``subprocess.run`` semantics, a timeout always)."""
        h = self.host(host)
        return subprocess.run(["ip", "netns", "exec", h.netns, *argv], timeout=timeout, **kwargs)

    # -- faults --------------------------------------------------------------------------------
    def partition(self, host: str | Host) -> None:
        """Cut ``host`` off the bridge: every packet to or from it is lost until ``heal``."""
        _ip("link", "set", self.host(host).link, "down")

    def heal(self, host: str | Host) -> None:
        _ip("link", "set", self.host(host).link, "up")

    def delay(self, host: str | Host, one_way_delay_s: float) -> None:
        """Delay every packet leaving ``host`` with ``tc netem`` (raises where netem is missing:
        use ``relay`` there)."""
        h = self.host(host)
        ms = f"{one_way_delay_s * 1000:.3f}ms"
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                h.netns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "netem",
                "delay",
                ms,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"tc netem is not available here ({done.stderr.strip()}); use NetLab.relay")

    def relay(
        self, host: str | Host, port: int, to: tuple[str, int], one_way_delay_s: float
    ) -> subprocess.Popen:
        """A latency relay in ``host``: connections to ``host.address:port`` are forwarded to
        ``to`` (an address reachable from ``host``), every chunk held ``one_way_delay_s`` in each
        direction. Returns once it listens. ``cut(relay)`` / ``mend(relay)`` partition and heal
        that one service."""
        h = self.host(host)
        argv = [
            sys.executable, "-m", "stallfree.testing.netlab", "relay",
            "--listen", f"{h.address}:{port}", "--to", f"{to[0]}:{to[1]}",
            "--delay", str(one_way_delay_s),
        ]  # fmt: skip
        p = self.popen(h, argv, stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("listening"):
            p.kill()
            raise RuntimeError(f"relay in {h.name} did not start: {line!r}")
        return p

    @staticmethod
    def cut(relay: subprocess.Popen) -> None:
        """Partition the service behind ``relay`` (100% loss for its connections, new and open)."""
        relay.send_signal(signal.SIGUSR1)

    @staticmethod
    def mend(relay: subprocess.Popen) -> None:
        """Heal ``cut``: held traffic goes through, as TCP's retransmissions would."""
        relay.send_signal(signal.SIGUSR2)


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL whatever still runs in ``netns`` (a grandchild that left our process group)."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    for token in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(token), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        if not left:
            return
        time.sleep(0.05)


# -- the latency relay (runs as its own process inside a namespace) ---------------------------------
class DelayedWriter:
    """A stream writer whose every write reaches the peer ``delay_s`` after it was made, in
    order: one direction of a link with that one-way delay (bandwidth not limited, so nothing
    waits on ``drain``). Nothing is written while ``flowing`` (when given) is clear: a partition,
    held as TCP retransmits, until healed. With no delay and no ``flowing`` it is the writer."""

    def __init__(
        self, writer: asyncio.StreamWriter, delay_s: float, flowing: asyncio.Event | None = None
    ) -> None:
        self.writer, self.delay_s, self.flowing = writer, delay_s, flowing
        self._queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        held = delay_s > 0 or flowing is not None
        self._task = asyncio.get_running_loop().create_task(self._send()) if held else None

    def write(self, data: bytes) -> None:
        """Queue ``data``; ``b""`` is the end of the stream (EOF after what came before)."""
        if self._task is None:
            if data:
                self.writer.write(data)
            elif self.writer.can_write_eof():
                self.writer.write_eof()
        else:
            self._queue.put_nowait((asyncio.get_running_loop().time() + self.delay_s, data))

    async def drain(self) -> None:
        if self._task is None:
            await self.writer.drain()

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await self._queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.flowing is not None:
                await self.flowing.wait()
            if not data:
                with contextlib.suppress(OSError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                return
            self.writer.write(data)
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()

    async def finish(self) -> None:
        """Write the end of the stream after what is queued, and wait until it is delivered."""
        self.write(b"")
        if self._task is not None:
            await self._task

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, flowing: asyncio.Event
) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay_s`` after it was read, in order;
    nothing is written while ``flowing`` is clear."""
    out = DelayedWriter(writer, delay_s, flowing)
    try:
        while True:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                data = b""
            if not data:
                break
            out.write(data)
        await out.finish()
    finally:
        out.cancel()


async def _serve_relay(listen: tuple[str, int], to: tuple[str, int], delay_s: float) -> None:
    """Serve until killed. SIGUSR1 cuts the relayed flow (100% loss: nothing passes, new
    connections are not answered), SIGUSR2 heals it: a partition of this one service, where
    ``NetLab.partition`` cuts a whole host."""
    flowing = asyncio.Event()
    flowing.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, flowing.clear)
    loop.add_signal_handler(signal.SIGUSR2, flowing.set)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await flowing.wait()
        await asyncio.sleep(delay_s)  # the SYN's trip
        try:
            server_r, server_w = await asyncio.open_connection(*to)
        except OSError:
            client_w.close()
            return
        await asyncio.sleep(delay_s)  # the SYN-ACK's trip back
        try:
            await asyncio.gather(
                _pump(client_r, server_w, delay_s, flowing), _pump(server_r, client_w, delay_s, flowing)
            )
        finally:
            for w in (client_w, server_w):
                w.close()

    server = await asyncio.start_server(handle, listen[0], listen[1], reuse_address=True)
    sys.stdout.write(f"listening on {listen[0]}:{listen[1]}\n")  # the parent waits for this line
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


class TrickleRelay:
    """A TCP relay on loopback whose answers trickle: each response to a request whose request
    line contains ``match`` gets its status line and headers at once (all of it trickles with
    ``headers=True``), then its body one byte every ``interval_s`` (each gap far under any read
    timeout); other requests pass as they are. A server that answers but never finishes, for tests of
    read deadlines (issue 36). Runs its own event loop on a daemon thread; a context manager.
    ``url`` is where clients connect (``http://127.0.0.1:PORT``), ``to`` where it forwards;
    ``trickling`` is set once a body has started to trickle."""

    def __init__(
        self,
        to: tuple[str, int],
        interval_s: float,
        *,
        match: bytes = b"",
        headers: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.to, self.interval_s, self.match, self.host = to, interval_s, match, host
        self.headers = headers
        self.port = 0
        self.trickling = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> TrickleRelay:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._serve(ready))
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failed.append(exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="stallfree-trickle-relay", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failed or not self.port:
            raise RuntimeError(f"the trickle relay did not start: {failed[0] if failed else 'no port'}")
        return self

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await self._stop.wait()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.to)
        except OSError:
            client_w.close()
            return
        state = {"trickle": False, "headers": True}  # of the response now coming back

        async def requests() -> None:
            while data := await client_r.read(1 << 16):
                line = data.split(b"\r\n", 1)[0]
                if line.split(b" ", 1)[0] in (b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"):
                    state["trickle"], state["headers"] = self.match in line, not self.headers
                server_w.write(data)
                await server_w.drain()

        async def responses() -> None:
            while data := await server_r.read(1 << 16):
                if state["trickle"] and state["headers"]:
                    cut = data.find(b"\r\n\r\n")
                    head, data = (data, b"") if cut < 0 else (data[: cut + 4], data[cut + 4 :])
                    client_w.write(head)
                    state["headers"] = cut < 0
                if not state["trickle"]:
                    client_w.write(data)
                    await client_w.drain()
                    continue
                for i in range(len(data)):
                    self.trickling.set()
                    await asyncio.sleep(self.interval_s)
                    client_w.write(data[i : i + 1])
                    await client_w.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(responses())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, OSError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (client_w, server_w):
                w.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> TrickleRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stallfree.testing.netlab")
    sub = parser.add_subparsers(dest="cmd", required=True)
    relay = sub.add_parser("relay", help="a TCP relay that delays every chunk both ways")
    relay.add_argument("--listen", required=True, type=_address, help="ADDRESS:PORT to listen on")
    relay.add_argument("--to", required=True, type=_address, help="ADDRESS:PORT to forward to")
    relay.add_argument("--delay", required=True, type=float, help="one-way delay in seconds")
    args = parser.parse_args(argv)
    asyncio.run(_serve_relay(args.listen, args.to, args.delay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
