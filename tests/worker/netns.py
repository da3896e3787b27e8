"""Hosts of their own on one machine: a network namespace per host, joined by a bridge (iproute2, as root).

Each host has an address on the bridge's subnet and reaches the others, and this process reaches them all
(the bridge carries an address of the subnet too). `cut(i)` takes host i's link down: its packets go
nowhere and nothing answers it (no reset), which is what a switch port failing or a partition looks like;
`heal(i)` brings the link back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import weakref


def available() -> str | None:
    """None where namespaces can be made here; otherwise why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (apt-get install iproute2)"
    return None


def _ip(*arguments: str, namespace: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


class Hosts:
    """`count` namespaces on a bridge; a context manager that removes them all on leaving."""

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 10_000
        self.subnet = f"10.213.{os.getpid() % 200}"
        self.bridge = f"swbr{tag}"
        self.namespaces = [f"sw{tag}-h{i}" for i in range(count)]
        self.links = [f"swv{tag}h{i}" for i in range(count)]  # the bridge side of each host's veth pair
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(count)]
        self._finalizer = weakref.finalize(self, _remove, list(self.namespaces), self.bridge)

    @property
    def wrappers(self) -> list[list[str]]:
        """The command prefix that runs a program on each host."""
        return [["ip", "netns", "exec", namespace] for namespace in self.namespaces]

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for namespace, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
                _ip("netns", "add", namespace)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("addr", "add", f"{address}/24", "dev", "eth0", namespace=namespace)
                _ip("link", "set", "eth0", "up", namespace=namespace)
                _ip("link", "set", "lo", "up", namespace=namespace)
        except BaseException:
            self._finalizer()
            raise
        return self

    def cut(self, index: int) -> None:
        _ip("link", "set", self.links[index], "down")

    def heal(self, index: int) -> None:
        _ip("link", "set", self.links[index], "up")

    def __exit__(self, *exc: object) -> None:
        self._finalizer()


def _remove(namespaces: list[str], bridge: str) -> None:
    for namespace in namespaces:  # removing a namespace removes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
