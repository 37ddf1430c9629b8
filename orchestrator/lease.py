"""The run's orchestrator lease: one orchestrator per run at a time.

A second orchestrator of the same run (a restart racing a live one) waits for the lease
instead of cutting the same steps. While held, the lease also renews the run-alive mark
that keeps the run's queued tasks worth running, the run's claim of its ZMQ port pair
(transport.port_claims: another run of this Redis holding it stops this one) and the
expiry of every key of the run, and notices a Redis that came back empty.

Every key of a run is written with an expiry (`DEFAULT_TTL_SECONDS`), because a SIGKILL
runs no handler: what a killed run leaves expires, late enough to resume it. A key a live
run keeps but seldom writes (its start marker, its settings, a counter) would expire under
it, so the lease renews them all every `RENEW_SECONDS` (`AsyncPayloadStore.expire_run`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from orchestrator.errors import CannotShip, LeaseLost, RunStateLost
from orchestrator.waits import event_set_within
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.port_claims import claim_call, claim_holder, release_call
from transport.store import AsyncPayloadStore

log = logging.getLogger("rlship.orchestrator")

LEASE_SECONDS = 5  # a killed orchestrator's successor waits at most this long to start
# The run-alive mark outlives its orchestrator by this much: a restarted one (which waits out
# the lease) finds its tasks still running; a run killed for good has its tasks dropped after.
ALIVE_SECONDS = 30
RENEW_SECONDS = 600  # far below DEFAULT_TTL_SECONDS: a renewal missed or late loses nothing


class Lease:
    def __init__(
        self,
        client: aioredis.Redis,
        run_id: str,
        stopping: asyncio.Event,
        on_lost: Callable[[Exception], None],
        loss_report: Callable[[], dict[str, Any]],
        ports: tuple[str, int] | None = None,
    ) -> None:
        self.client = client
        self.ports = ports  # the ZMQ (host, port) whose pair the run claims; None: no ZMQ
        self.run_id = run_id
        self.keys = RunKeys(run_id)
        self.store = AsyncPayloadStore(client, run_id)
        self.stopping = stopping
        self.on_lost = on_lost  # stops the run with the error that ended the lease
        self.loss_report = loss_report  # what a Redis that came back empty took with it
        self.token = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        self.acquired = asyncio.Event()

    async def hold(self) -> None:
        """Take the lease (waiting while another orchestrator holds it), then renew it, the
        alive mark and the run's keys until stopped; release it at the end."""
        token = self.token
        waiting_logged = False
        while not self.acquired.is_set():
            if await self.client.set(self.keys.orchestrator_lease, token, nx=True, ex=LEASE_SECONDS):
                if not await self._claim_ports():
                    await self.client.delete(self.keys.orchestrator_lease)
                    return
                await self.client.set(self.keys.run_marker, time.time(), nx=True, ex=DEFAULT_TTL_SECONDS)
                await self.client.set(self.keys.alive, token, ex=ALIVE_SECONDS)
                self.acquired.set()
                break
            if not waiting_logged:
                log.warning("run %s: another orchestrator holds the lease; waiting", self.run_id)
                waiting_logged = True
            await asyncio.sleep(LEASE_SECONDS / 5)
        await self.store.expire_run()  # a resumed run's keys live as long as a new run's
        renewed = time.monotonic()
        while not self.stopping.is_set():
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(self.keys.run_marker)
            pipe.set(self.keys.orchestrator_lease, token, nx=True, ex=LEASE_SECONDS)
            pipe.get(self.keys.orchestrator_lease)
            pipe.set(self.keys.alive, token, ex=ALIVE_SECONDS)
            marker, _, holder, _ = await pipe.execute()
            if not marker:
                self.on_lost(RunStateLost(self.run_id, self.loss_report()))
                return
            if holder != token.encode():
                self.on_lost(LeaseLost(f"run {self.run_id}: another orchestrator took the lease"))
                return
            await self.client.expire(self.keys.orchestrator_lease, LEASE_SECONDS)
            if not await self._claim_ports():
                return
            if time.monotonic() - renewed >= RENEW_SECONDS:
                await self.store.expire_run()
                renewed = time.monotonic()
            await event_set_within(self.stopping, LEASE_SECONDS / 5)
        await self.client.delete(self.keys.orchestrator_lease)
        if self.ports is not None:
            await self.client.eval(*release_call(self.run_id, *self.ports))

    async def _claim_ports(self) -> bool:
        """Claim (or renew) the run's port pair; False, and the run stopped, if another
        live run of this Redis holds it."""
        if self.ports is None:
            return True
        host, port = self.ports
        holder = claim_holder(await self.client.eval(*claim_call(self.run_id, host, port, ALIVE_SECONDS)))
        if holder is not None:
            self.on_lost(
                CannotShip(
                    f"run {self.run_id}: zmq_port {host}:{port} (and READY {port + 1}) is held by live run "
                    f"{holder} of this Redis: choose another --zmq-port"
                )
            )
        return holder is None
