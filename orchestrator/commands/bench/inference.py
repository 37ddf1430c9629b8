"""The orchestrator loop's own inference traffic in `rlship bench loop --inference-concurrency`.

prime-rl's orchestrator drives inference from the same event loop that ships its steps: it
keeps hundreds of requests in flight to the inference servers and turns each answer into a
rollout. `InferenceLoad` does that work on the placement process's loop: C request loops,
each sending a streaming chat completion to the mock inference server (`mock_inference`,
another process) through one aiohttp session, reading the answer chunk by chunk (token ids
named `token_id:N`, their logprobs), then building the rollout's record and arrays and, a
group at a time, running the producer's own checks on them (`check_rollouts`). The rollouts
are kept, one step's worth, as the next steps' would be; they are not shipped (the bench's
steps are seeded, so every placement ships the same bytes).

The load runs first alone (`warmup`, then the `baseline` phase: nothing ships), then while
the placement ships; `inference_figures` makes its figures of what it noted (`result`).
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np

from orchestrator.lag_probe import LagProbe
from orchestrator.records import RolloutRecord
from orchestrator.rollout_checks import check_rollouts

TOKEN_BIN_SECONDS = 0.01  # tokens received are counted in bins of this width (inference_figures)
READ_TIMEOUT_SECONDS = 600.0  # no byte of an answer for this long: the request fails, the bench with it
Rollout = tuple[RolloutRecord, dict[str, np.ndarray]]


@dataclass(frozen=True)
class InferenceSpec:
    """What the load does: against which server, how many requests in flight, how long alone."""

    url: str
    concurrency: int
    warmup_seconds: float
    baseline_seconds: float
    seq_len: int
    vocab_size: int
    group_size: int
    rollouts_kept: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class InferenceLoad:
    """C requests in flight on this loop, each answer read as it streams and made a rollout."""

    def __init__(self, spec: InferenceSpec, origin: float) -> None:
        self.spec = spec
        self.origin = origin
        self.started = array("d")
        self.first_token = array("d")
        self.ended = array("d")
        self.tokens = array("q")
        self.token_bins = array("q")
        self.baseline: tuple[float, float] | None = None
        self.baseline_lag_ms = np.zeros(0)  # the loop's lag in the baseline, each 10 ms probe's
        self.rollouts: deque[Rollout] = deque(maxlen=spec.rollouts_kept)
        self._group: list[Rollout] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="inference-load")
        return self._task

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.spec.concurrency)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(self.spec.url, connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._requests(session) for _ in range(self.spec.concurrency)))

    async def _requests(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.request(session)

    async def measure_baseline(self) -> None:
        """The phase without shipping: after the warm-up, `baseline_seconds` of the load alone,
        with the loop's lag probed as the ship windows' is (what the load alone does to it)."""
        loop = asyncio.get_running_loop()
        await self.while_running(asyncio.sleep(self.spec.warmup_seconds))
        began = loop.time() - self.origin
        probe = LagProbe()
        probing = asyncio.create_task(probe.run())
        try:
            await self.while_running(asyncio.sleep(self.spec.baseline_seconds))
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
        self.baseline = (began, loop.time() - self.origin)
        self.baseline_lag_ms = probe.take_window()

    async def while_running(self, awaitable: Any) -> None:
        """Await `awaitable` (the shipping, say) beside the load; if the load fails meanwhile,
        raise its error at once: the bench fails loudly, it never measures a dead load."""
        assert self._task is not None
        waiter = asyncio.ensure_future(awaitable)
        await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            waiter.cancel()
            raise RuntimeError("the inference load stopped") from self._task.exception()
        await waiter

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def request(self, session: aiohttp.ClientSession) -> None:
        """One request: a streaming chat completion read chunk by chunk, then its rollout."""
        loop = asyncio.get_running_loop()
        body = {
            "model": "rlship-mock",
            "messages": [{"role": "user", "content": "Solve the task."}],
            "max_tokens": self.spec.seq_len,
            "stream": True,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        started = loop.time()
        first = None
        prompt: list[int] = []
        ids: list[int] = []
        logprobs: list[float] = []
        finish = None
        async with session.post("/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"inference server answered {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                prompt = chunk.get("prompt_token_ids", prompt)
                choice = chunk["choices"][0]
                received = choice["logprobs"]["content"]
                ids.extend(int(token["token"].rpartition(":")[2]) for token in received)
                logprobs.extend(token["logprob"] for token in received)
                finish = choice["finish_reason"] or finish
                now = loop.time()
                if first is None:
                    first = now
                self._count_tokens(now, len(received))
        if first is None or finish is None:
            raise RuntimeError(f"inference server: an answer of {len(ids)} tokens ended without [DONE]")
        ended = loop.time()
        self.keep(self.rollout(prompt, ids, logprobs, finish))
        for column, value in ((self.started, started), (self.first_token, first), (self.ended, ended)):
            column.append(value - self.origin)
        self.tokens.append(len(ids))

    def _count_tokens(self, now: float, count: int) -> None:
        index = int((now - self.origin) / TOKEN_BIN_SECONDS)
        if index >= len(self.token_bins):
            self.token_bins.extend([0] * (index + 1 - len(self.token_bins)))
        self.token_bins[index] += count

    def rollout(self, prompt: list[int], ids: list[int], logprobs: list[float], finish: str) -> Rollout:
        """The answer as a producer hands it over: the record and the token arrays."""
        number = len(self.ended) + len(self._group)
        record = RolloutRecord(
            rollout_id=f"inference-{number}",
            group_id=f"inference-g{number // self.spec.group_size}",
            task_id="mock-task",
            env="mock",
            policy_version=0,
            reward=0.0,
            num_input_tokens=len(prompt),
            num_output_tokens=len(ids),
            is_truncated=finish == "length",
            stop_condition=finish,
        )
        input_ids = np.concatenate([np.asarray(prompt, np.int32), np.asarray(ids, np.int32)])
        loss_mask = np.zeros(len(input_ids), dtype=bool)
        loss_mask[len(prompt) :] = True
        inference_logprobs = np.zeros(len(input_ids), dtype=np.float32)
        inference_logprobs[len(prompt) :] = logprobs
        arrays = {"input_ids": input_ids, "loss_mask": loss_mask, "inference_logprobs": inference_logprobs}
        return record, arrays

    def keep(self, rollout: Rollout) -> None:
        """A group at a time, the producer's checks, then into the next steps' rollouts."""
        self._group.append(rollout)
        if len(self._group) == self.spec.group_size:
            check_rollouts(self._group, self.spec.seq_len, self.spec.vocab_size)
            self.rollouts.extend(self._group)
            self._group = []

    def result(self) -> dict[str, Any]:
        """What the figures are made of, on the placement's clock (seconds since its origin)."""
        return {
            "spec": self.spec.to_json(),
            "baseline": list(self.baseline) if self.baseline else None,
            "baseline_lag_ms": self.baseline_lag_ms.round(3).tolist(),
            "started": list(self.started),
            "first_token": list(self.first_token),
            "ended": list(self.ended),
            "tokens": list(self.tokens),
            "token_bins": list(self.token_bins),
            "token_bin_seconds": TOKEN_BIN_SECONDS,
            "rollouts_kept": len(self.rollouts),
        }
