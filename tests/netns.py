"""Separate network hosts on this machine for the tests: Linux network namespaces.

Each host is a network namespace with loopback and one veth link to a bridge in a
"switch" namespace, on a private /24 (10.213.N.0/24, checked unused first).  The
test process itself stays in the root namespace and reaches the hosts through one
more veth pair to the switch, with the subnet's first address (root's only route to
the subnet; root does not forward).  Nothing else gets an address, so only those
addresses and each namespace's loopback carry the cluster's traffic.

Names carry the creating process's pid: namespaces ``skv<pid>-<host>``, links
``v<code><pid>`` (a host's end), ``s<code><pid>`` (its switch port), ``skvr<pid>``
(root's end).  :meth:`HostNetwork.close` deletes them all, also after a failed
:func:`create_network`; a run killed before it could leaves them, and the next run
deletes those whose pid is gone.  Needs root and iproute2 (``ip``, ``ss``);
:func:`unavailable_reason` says why not, for a skip.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["HostNetwork", "NetHost", "create_network", "unavailable_reason"]

SUBNET_PREFIX = "10.213"
_BYTES_RECEIVED_RE = re.compile(r"\bbytes_received:(\d+)")
_NETNS_RE = re.compile(r"^skv(\d+)-")
_ROOT_LINK_RE = re.compile(r"^skvr(\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def unavailable_reason() -> str | None:
    """Why this process cannot create network namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); not running as root"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"network namespaces need iproute2: {tool!r} not found"
    probe = f"skv{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class NetHost:
    """One host: a network namespace with one link to the switch."""

    name: str
    netns: str
    interface: str     # inside the namespace
    address: str

    @property
    def command_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def interface_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on this host's link, from the kernel's counters."""
        out = _ip("-n", self.netns, "-s", "-j", "link", "show", "dev", self.interface)
        stats = json.loads(out.stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def tcp_bytes_received_from(self, peer: str) -> dict[tuple[str, str], int]:
        """Bytes this host received on each open TCP connection with ``peer``
        (``ss -ti``'s bytes_received), keyed by (local, remote) address:port."""
        out = subprocess.run([*self.command_prefix, "ss", "-tinH", "dst", peer],
                             capture_output=True, text=True, check=True, timeout=30)
        received: dict[tuple[str, str], int] = {}
        key = None
        for line in out.stdout.splitlines():
            fields = line.split()
            if fields and not line[0].isspace() and len(fields) >= 5:
                key = (fields[3], fields[4])   # State Recv-Q Send-Q Local Peer
                received[key] = 0
            match = _BYTES_RECEIVED_RE.search(line)
            if match and key is not None:
                received[key] = int(match.group(1))
        return received


def received_since(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int]
                   ) -> int:
    """Bytes received between two :meth:`NetHost.tcp_bytes_received_from` readings,
    over the connections open at the second (new ones count from zero)."""
    return sum(n - before.get(key, 0) for key, n in after.items())


@dataclass
class HostNetwork:
    """The namespaces and links of one run; :meth:`close` removes them."""

    run_id: str
    subnet: ipaddress.IPv4Network
    switch: str
    bridge: str
    root_interface: str
    root_address: str
    hosts: dict[str, NetHost] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)   # created, to delete

    def close(self) -> list[str]:
        """Delete every namespace and link of this run; return those still there."""
        for netns in reversed(self.namespaces):
            _ip("netns", "del", netns, check=False)
        # Gone with the switch namespace (its peer); deleted here if that failed.
        _ip("link", "del", self.root_interface, check=False)
        listed = _ip("netns", "list", check=False).stdout.split()
        left = [n for n in self.namespaces if n in listed]
        if _ip("link", "show", "dev", self.root_interface, check=False).returncode == 0:
            left.append(self.root_interface)
        return left


def _remove_stale() -> None:
    """Delete namespaces and root links of earlier runs whose process is gone."""
    for netns in _ip("netns", "list", check=False).stdout.split():
        match = _NETNS_RE.match(netns)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", netns, check=False)
    for link in json.loads(_ip("-j", "link", "show", check=False).stdout or "[]"):
        match = _ROOT_LINK_RE.match(link.get("ifname", ""))
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("link", "del", link["ifname"], check=False)


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of every address and route in the root namespace and of every
    address in the other named namespaces."""
    used = []
    for netns in [None, *_ip("netns", "list", check=False).stdout.split()]:
        if netns is not None and netns.startswith("("):
            continue  # "(id: N)" after a name
        prefix = [] if netns is None else ["-n", netns]
        for entry in json.loads(_ip(*prefix, "-4", "-j", "addr", check=False).stdout or "[]"):
            for info in entry.get("addr_info", []):
                used.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}",
                                                 strict=False))
    for route in json.loads(_ip("-4", "-j", "route", check=False).stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            used.append(ipaddress.ip_network(dst, strict=False))
    return used


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    used = _subnets_in_use()
    for i in range(254):
        candidate = ipaddress.ip_network(f"{SUBNET_PREFIX}.{(seed + i) % 254 + 1}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise RuntimeError(f"no free {SUBNET_PREFIX}.N.0/24 subnet")


def create_network(hosts: dict[str, str]) -> HostNetwork:
    """Create one host per ``{name: one-letter code}``, joined by a switch, and root's
    link to it.  On failure everything made so far is deleted."""
    pid = os.getpid()
    _remove_stale()
    subnet = _free_subnet(pid)
    addresses = subnet.hosts()
    root_address = str(next(addresses))
    net = HostNetwork(run_id=str(pid), subnet=subnet, switch=f"skv{pid}-switch",
                      bridge=f"br{pid}", root_interface=f"skvr{pid}",
                      root_address=root_address)
    try:
        _ip("netns", "add", net.switch)
        net.namespaces.append(net.switch)
        _ip("-n", net.switch, "link", "add", "name", net.bridge, "type", "bridge")
        _ip("-n", net.switch, "link", "set", net.bridge, "up")
        links = [(None, net.root_interface, f"sr{pid}", root_address)]
        for name, code in hosts.items():
            host = NetHost(name=name, netns=f"skv{pid}-{name}", interface=f"v{code}{pid}",
                           address=str(next(addresses)))
            _ip("netns", "add", host.netns)
            net.namespaces.append(host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            net.hosts[name] = host
            links.append((host.netns, host.interface, f"s{code}{pid}", host.address))
        for netns, interface, port, address in links:
            where = [] if netns is None else ["netns", netns]
            _ip("link", "add", "name", interface, *where, "type", "veth",
                "peer", "name", port, "netns", net.switch)
            inside = [] if netns is None else ["-n", netns]
            _ip(*inside, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", interface)
            _ip(*inside, "link", "set", interface, "up")
            _ip("-n", net.switch, "link", "set", port, "master", net.bridge, "up")
    except BaseException:
        net.close()
        raise
    return net
