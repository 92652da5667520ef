"""Hosts of their own on one machine, for the multi-host tests: network namespaces, each with
one end of a veth pair whose other end is on a bridge here, so each has its own address on one
subnet (10.7x.<n>.0/24, one per call; this namespace is .1 on the bridge) and reaches the others only through
its link. Taking a host's link down cuts it off as a pulled cable would: its packets vanish, no
connection is refused or reset. Needs CAP_NET_ADMIN (root in CI); `hosts` skips the test with
the kernel's words where namespaces are refused."""
from __future__ import annotations

import itertools
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import trio

PORT = 8000  # every host's server listens here: each host has an address of its own


_CALLS = itertools.count()
_SUBNETS = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    namespace: str
    address: str
    link: str  # this namespace's end of the host's veth pair
    inner_link: str  # the host's end, its one interface besides lo
    is_cut: bool = False

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Take the host's link down: from now on nothing reaches it, and it reaches nothing."""
        _ip("link", "set", self.link, "down")
        self.is_cut = True


@contextmanager
def hosts(count: int):
    """`count` Hosts, torn down (namespaces, links, bridge) on the way out, whatever happened."""
    tag = f"t{os.getpid() % 100000}{next(_CALLS)}"  # unique per call and process, names under 15 characters
    subnet = f"10.{70 + next(_SUBNETS) % 10}.{os.getpid() % 250}"
    bridge = f"{tag}br"
    made: list[str] = []
    links: list[str] = []
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"network namespaces are refused here: {e.stderr.strip()}")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        out = []
        for i in range(count):
            namespace, inner, outer = f"{tag}h{i}", f"{tag}i{i}", f"{tag}o{i}"
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            links.append(outer)
            _ip("link", "set", inner, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{subnet}.{10 + i}/24", "dev", inner)
            _ip("-n", namespace, "link", "set", inner, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            out.append(Host(namespace, f"{subnet}.{10 + i}", outer, inner))
        yield out
    finally:
        # A namespace outlives its name while a process is still in it, and its veth with it:
        # deleting this end takes the pair whatever lingers.
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


async def until_healthy(url: str, process: trio.Process) -> None:
    """Until `url`'s /health answers 200; fails if `process` (its server) exits first."""
    async with httpx.AsyncClient(timeout=2) as http:
        with trio.fail_after(300):
            while True:
                assert process.returncode is None, f"the server for {url} exited with {process.returncode}"
                try:
                    if (await http.get(url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)
