"""Hosts of their own on this machine, for tests and benches: Linux network namespaces, each with its own address,
reached from the root namespace over a link of its own.

A loopback hides what a network does: a process killed there always answers with a reset, and a round trip takes
microseconds. A namespace's end of its link taken down (``Host.pull``, ``ip link set DEV down`` inside it) drops
every packet with no FIN and no RST, as a pulled cable or a host that lost power does; a link can also carry a
delay (``hosts(n, delay_s=...)``). Two kinds of link:

- no delay: a veth pair (the kernel's own link), the namespace's end ``10.x.y.(4i+2)/30``, the root's ``.(4i+1)``;
- with a delay: two TUN devices, one in each namespace, and a relay process (``python -m service.testing.netns relay``)
  that copies each IP packet from one to the other after half the round trip: an emulated wire, since this
  kernel has no netem qdisc. Everything crosses it, TCP's handshake too, so a round trip measured by connecting
  (``service.rpc.client.round_trip_s``) sees the delay as on a real network. Its MTU is 65,000 bytes, so a
  megabyte of logits crosses in 17 packets (the relay costs a few microseconds a packet).

Needs root and iproute2 (``unavailable`` says why not, for a test's skip). Names carry this process's id; the
namespaces, their processes and links are removed on the way out, whatever happened; those of a process that was
killed before it could (SIGKILL) are removed by the next ``hosts``, and a relay ends with its parent.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import heapq
import itertools
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Iterator, Sequence

TUN_MTU = 65000
"""The delayed link's MTU (the TUN devices'): large packets, few of them for the relay to copy."""
_TUNSETIFF = 0x400454CA
_PR_SET_PDEATHSIG = 1
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


class NetnsError(RuntimeError):
    """An ``ip`` command failed (with its message)."""


def _ip(*args: str, ns: str | None = None) -> str:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (a test's skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    name = f"gguf-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (NetnsError, OSError) as exc:
        return f"cannot make a network namespace: {exc}"
    with contextlib.suppress(NetnsError, OSError):
        _ip("netns", "del", name)
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """A namespace as a host: its address, and the device of its end of the link."""

    ns: str
    address: str
    """Its address, which the root namespace reaches over the link."""
    gateway: str
    """The root namespace's address on the link (the host reaches the root at it)."""
    device: str
    """Its end of the link, inside the namespace."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the process's id is the command's own)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def pull(self) -> None:
        """Take the host's end of the link down: every packet either way is dropped, nothing answers, no reset."""
        _ip("link", "set", "dev", self.device, "down", ns=self.ns)

    def plug(self) -> None:
        """The link up again (its address and route come back with it)."""
        _ip("link", "set", "dev", self.device, "up", ns=self.ns)
        with contextlib.suppress(NetnsError):  # a point-to-point route is dropped with the link
            _ip("route", "replace", self.gateway, "dev", self.device, ns=self.ns)

    def pids(self) -> list[int]:
        """The processes running in the namespace."""
        try:
            return [int(p) for p in _ip("netns", "pids", self.ns).split()]
        except NetnsError:
            return []


def _free_block() -> int:
    """A /24 of 10.213.0.0/16 no address or route of the root namespace uses."""
    used = _ip("-4", "route", "show", "table", "all") + _ip("-4", "-o", "addr")
    for _ in range(1000):
        k = random.SystemRandom().randrange(1, 255)
        if f"10.213.{k}." not in used:
            return k
    raise NetnsError("no free /24 in 10.213.0.0/16")


def _kill_all(host: Host, timeout_s: float = 10.0) -> None:
    for pid in host.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too, but let it be reaped at once
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.05)


_made = itertools.count()


@contextlib.contextmanager
def hosts(n: int, *, delay_s: float | Sequence[float] = 0.0) -> Iterator[list[Host]]:
    """``n`` namespaces, each linked to the root namespace (a veth pair; with a delay, a relay that adds that round
    trip: ``delay_s`` for every host, or one per host); on the way out every process left in them is killed, and
    the namespaces and links removed."""
    delays = [float(delay_s)] * n if isinstance(delay_s, (int, float)) else [float(x) for x in delay_s]
    if len(delays) != n:
        raise ValueError(f"{n} hosts, {len(delays)} delays")
    _reap_stale()
    k = _free_block()
    tag = f"{os.getpid()}{chr(ord('a') + next(_made) % 26)}"
    made: list[Host] = []
    relays: list[subprocess.Popen[bytes]] = []
    try:
        for i, delay in enumerate(delays):
            ns = f"gguf-{tag}-{i}"
            root_addr, ns_addr = f"10.213.{k}.{4 * i + 1}", f"10.213.{k}.{4 * i + 2}"
            root_dev, ns_dev = f"g{tag}r{i}", f"g{tag}n{i}"
            _ip("netns", "add", ns)
            host = Host(ns, ns_addr, root_addr, ns_dev)
            made.append(host)
            _ip("link", "set", "lo", "up", ns=ns)
            if delay > 0:
                relay = subprocess.Popen([sys.executable, "-m", "service.testing.netns", "relay", "--ns", ns,
                                          "--root-dev", root_dev, "--ns-dev", ns_dev, "--root-addr", root_addr,
                                          "--ns-addr", ns_addr, "--delay-s", repr(delay)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                relays.append(relay)
                line = relay.stdout.readline() if relay.stdout else b""
                if line.strip() != b"ready":
                    err = relay.stderr.read().decode() if relay.stderr and relay.poll() is not None else ""
                    raise NetnsError(f"the link relay for {ns} did not start: {line!r} {err}")
            else:
                _ip("link", "add", root_dev, "type", "veth", "peer", "name", ns_dev, "netns", ns)
                _ip("addr", "add", f"{root_addr}/30", "dev", root_dev)
                _ip("link", "set", root_dev, "up")
                _ip("addr", "add", f"{ns_addr}/30", "dev", ns_dev, ns=ns)
                _ip("link", "set", ns_dev, "up", ns=ns)
        yield made
    finally:
        for host in made:
            _kill_all(host)
        for relay in relays:
            relay.kill()
            relay.wait()
        for host in made:
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", host.ns)
        for i in range(len(made)):
            with contextlib.suppress(NetnsError):  # a veth pair goes with its namespace's end; in case it did not
                _ip("link", "del", f"g{tag}r{i}")


def _reap_stale() -> None:
    """Namespaces an earlier process of these made and could not remove (it was killed): their processes killed,
    the namespaces deleted (a veth pair goes with its namespace's end, a relay with its parent)."""
    for ns in namespaces():
        owner = ns.split("-")[1][:-1] if ns.startswith("gguf-") and ns.count("-") == 2 else ""
        if not owner.isdigit() or int(owner) == os.getpid() or os.path.exists(f"/proc/{owner}"):
            continue
        host = Host(ns, "", "", "")
        _kill_all(host)
        with contextlib.suppress(NetnsError):
            _ip("netns", "del", ns)


def namespaces() -> list[str]:
    """The network namespaces that exist now (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


# -- the delayed link's relay (a process of its own)

def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def relay(root_fd: int, ns_fd: int, one_way_s: float) -> None:
    """Copy each packet from one TUN device to the other ``one_way_s`` after it arrived, in order, for ever.
    ``select`` waits with microseconds (epoll's timeout counts milliseconds); a write to a device that is down
    (a pulled link) drops the packet, as the wire would."""
    other = {root_fd: ns_fd, ns_fd: root_fd}
    due: list[tuple[float, int, int, bytes]] = []
    seq = 0
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        ready, _, _ = select.select([root_fd, ns_fd], [], [], wait)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the device is down
                    break
                heapq.heappush(due, (now + one_way_s, seq, other[fd], packet))
                seq += 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, packet = heapq.heappop(due)
            with contextlib.suppress(OSError):
                os.write(out, packet)


def _relay_main(args: argparse.Namespace) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # its devices go with its parent
    root_fd, ns_fd = _tun(args.root_dev), _tun(args.ns_dev)
    _ip("link", "set", args.ns_dev, "netns", args.ns)
    _ip("addr", "add", args.root_addr, "peer", args.ns_addr, "dev", args.root_dev)
    _ip("link", "set", args.root_dev, "mtu", str(TUN_MTU), "up")
    _ip("addr", "add", args.ns_addr, "peer", args.root_addr, "dev", args.ns_dev, ns=args.ns)
    _ip("link", "set", args.ns_dev, "mtu", str(TUN_MTU), "up", ns=args.ns)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    relay(root_fd, ns_fd, args.delay_s / 2)
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.testing.netns", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("relay", help="a delayed link between the root namespace and NS (two TUN devices)")
    r.add_argument("--ns", required=True)
    r.add_argument("--root-dev", required=True)
    r.add_argument("--ns-dev", required=True)
    r.add_argument("--root-addr", required=True)
    r.add_argument("--ns-addr", required=True)
    r.add_argument("--delay-s", type=float, required=True, help="the round trip the link adds")
    args = ap.parse_args(argv)
    return _relay_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
