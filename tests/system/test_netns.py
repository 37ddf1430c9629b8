"""Scale-out across hosts, on one machine: Redis, the Celery workers and the trainer ranks
each run in their own network namespace, joined by veth pairs to a router namespace (a star
of /24 subnets; the test's own namespace is a spoke too and runs the producer and the
orchestrator). Nothing is shared but the addresses: the workers need only `REDIS_URL`, the
ship worker binds ZMQ on its namespace's address and the trainers connect to it. Every rank
must receive every step. Processes are ended by PID, namespaces deleted, even on failure.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from orchestrator.commands.processes import ProcessGroup, redis_answers, rlship_command, worker_commands
from orchestrator.commands.run_report import received_by_rank, sent_checksums
from orchestrator.settings import RunSettings, settings_to_env
from tests.support.processes import require
from transport.keys import RunKeys

REDIS_PORT = 6390
ZMQ_PORT = 5555  # each namespace has its own ports: no clash with anything on this machine
SPOKES = ("redis", "workers", "trainers")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    probe = f"rlship-probe-{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed: {exc.stderr.strip()}"
    ip("netns", "del", probe)
    return None


def free_subnet() -> int:
    """A second octet x such that 10.x.0.0/16 is used by no address or route here."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    free = [x for x in range(64, 255) if f"10.{x}." not in used]
    return random.choice(free)


@dataclass
class Star:
    """A router namespace and spokes, spoke i on 10.x.i.0/24: router .1, spoke .2."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    subnet: int = field(default_factory=free_subnet)
    namespaces: list[str] = field(default_factory=list)

    @property
    def router(self) -> str:
        return f"rlship-{self.tag}-router"

    def namespace(self, spoke: str) -> str:
        return f"rlship-{self.tag}-{spoke}"

    def address(self, index: int, host: int = 2) -> str:
        return f"10.{self.subnet}.{index}.{host}"

    def add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def link(self, index: int, namespace: str | None) -> None:
        """A veth pair from the router to spoke `index` (None: the test's own namespace)."""
        near, far = f"rl{self.tag}{index}r", f"rl{self.tag}{index}s"
        spoke = ["netns", namespace] if namespace else []
        ip("link", "add", near, "netns", self.router, "type", "veth", "peer", "name", far, *spoke)
        ip("-n", self.router, "addr", "add", f"{self.address(index, 1)}/24", "dev", near)
        ip("-n", self.router, "link", "set", near, "up")
        in_spoke = ["-n", namespace] if namespace else []
        ip(*in_spoke, "addr", "add", f"{self.address(index)}/24", "dev", far)
        ip(*in_spoke, "link", "set", far, "up")
        if namespace:
            ip(*in_spoke, "route", "add", "default", "via", self.address(index, 1))
        else:
            ip("route", "add", f"10.{self.subnet}.0.0/16", "via", self.address(index, 1))

    def build(self) -> None:
        self.add_namespace(self.router)
        forward = "echo 1 > /proc/sys/net/ipv4/ip_forward"
        subprocess.run(["ip", "netns", "exec", self.router, "sh", "-c", forward], check=True, timeout=30)
        for index, spoke in enumerate(SPOKES, start=1):
            self.add_namespace(self.namespace(spoke))
            self.link(index, self.namespace(spoke))
        self.link(len(SPOKES) + 1, None)

    def delete(self) -> None:
        """Deleting a namespace deletes its veth ends, their peers and the routes over them."""
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        own_end = f"rl{self.tag}{len(SPOKES) + 1}s"
        subprocess.run(["ip", "link", "del", own_end], capture_output=True, timeout=30)


@contextlib.contextmanager
def star_network() -> Iterator[Star]:
    star = Star()
    try:
        star.build()
        yield star
    finally:
        star.delete()


def in_netns(namespace: str, command: list[str]) -> list[str]:
    """`ip netns exec` enters the namespace and execs the command: same PID, stopped by it."""
    return ["ip", "netns", "exec", namespace, *command]


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def wait_for(condition: Callable[[], bool], timeout: float, what: str, group: ProcessGroup) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if group.failed():
            raise AssertionError(f"{what}: processes failed {group.failed()}; logs in {group.log_dir}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; logs in {group.log_dir}")
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_redis_workers_and_trainers_in_separate_network_namespaces(tmp_path: Path) -> None:
    require("root, `ip netns` and redis-server (network namespaces)", netns_unavailable())
    with star_network() as star:
        redis_address, worker_address = star.address(1), star.address(2)
        password = secrets.token_hex(8)  # as a Redis reachable from other hosts must have
        settings = RunSettings(
            run_id=f"netns-{star.tag}",
            redis_url=f"redis://:{password}@{redis_address}:{REDIS_PORT}/0",
            steps=3,
            ranks=2,
            batch_size=16,
            group_size=4,
            seq_len=512,
            zmq_host=worker_address,
            zmq_port=ZMQ_PORT,
            output_dir=tmp_path,
            cpu_workers=1,
        )
        group = ProcessGroup(env=settings_to_env(settings), log_dir=tmp_path / "logs")
        try:
            redis_server = [
                "redis-server", "--port", str(REDIS_PORT), "--bind", redis_address,
                "--requirepass", password, "--save", "", "--appendonly", "no", "--daemonize", "no",
            ]  # fmt: skip
            group.start("redis", in_netns(star.namespace("redis"), redis_server))
            wait_for(lambda: redis_answers(settings.redis_url), 20, "Redis across the router", group)
            for name, command in worker_commands(settings).items():
                group.start(name, in_netns(star.namespace("workers"), command))
            for rank in range(settings.ranks):
                trainer = rlship_command("trainer", "--rank", str(rank))
                group.start(f"trainer-{rank}", in_netns(star.namespace("trainers"), trainer))
            group.start("producer", rlship_command("produce"))
            orchestrator = group.start(
                "orchestrator", rlship_command("orchestrate", "--summary-out", str(tmp_path / "summary.json"))
            )

            wait_for(lambda: orchestrator.poll() is not None, 150, "the orchestrator's steps", group)
            assert orchestrator.returncode == 0, f"orchestrator failed; logs in {group.log_dir}"
            for rank in range(settings.ranks):
                group.processes[f"trainer-{rank}"].wait(60)

            client = redis.Redis.from_url(settings.redis_url)
            checksums = sent_checksums(client, settings.run_id)
            for rank, received in received_by_rank(client, settings.run_id, settings.ranks).items():
                assert received["steps"] == [0, 1, 2], f"rank {rank}"
                assert received["checksums"] == [checksums[f"{s}:{rank}"] for s in range(3)]
            # Every stage ran in a worker process of the workers' namespace.
            workers_netns = os.stat(f"/run/netns/{star.namespace('workers')}").st_ino
            calls = client.hkeys(RunKeys(settings.run_id).stage_calls)  # "host:pid:stage"
            stage_pids = {int(call.decode().split(":")[1]) for call in calls}
            assert stage_pids and {netns_inode(pid) for pid in stage_pids} == {workers_netns}
            assert netns_inode(os.getpid()) != workers_netns
            for log in group.log_dir.iterdir():
                assert password not in log.read_text(errors="replace"), f"password in {log.name}"
        finally:
            group.stop_all()
