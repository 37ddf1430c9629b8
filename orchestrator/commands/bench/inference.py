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
the placement ships. `inference_figures` compares the requests completed per second, the
tokens received per second, the request latency and the time to first token of the
requests that completed (first token arrived) inside the measured ship windows with the
same in the baseline. Selecting by completion time keeps both sets of requests' lengths
distributed as all of them are (selecting by overlap with a window would favour long ones).
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

from orchestrator.records import RolloutRecord
from orchestrator.rollout_checks import check_rollouts

TOKEN_BIN_SECONDS = 0.01  # tokens received are counted in bins of this width
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
        """The phase without shipping: after the warm-up, `baseline_seconds` of the load alone."""
        loop = asyncio.get_running_loop()
        await self.while_running(asyncio.sleep(self.spec.warmup_seconds))
        began = loop.time() - self.origin
        await self.while_running(asyncio.sleep(self.spec.baseline_seconds))
        self.baseline = (began, loop.time() - self.origin)

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
            "started": list(self.started),
            "first_token": list(self.first_token),
            "ended": list(self.ended),
            "tokens": list(self.tokens),
            "token_bins": list(self.token_bins),
            "token_bin_seconds": TOKEN_BIN_SECONDS,
            "rollouts_kept": len(self.rollouts),
        }


def _within(times: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    keep = np.zeros(len(times), dtype=bool)
    for start, end in spans:
        keep |= (times >= start) & (times <= end)
    return keep


def _percentiles_ms(seconds: np.ndarray) -> dict[str, float]:
    if not len(seconds):
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.percentile(seconds * 1000.0, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def phase_figures(raw: dict[str, Any], spans: list[tuple[float, float]]) -> dict[str, Any]:
    """The load's figures over these spans: requests completed and tokens received per
    second, the latency of the requests completed in them, the time to first token of
    those whose first token came in them."""
    started, first, ended = (
        np.asarray(raw[name], np.float64) for name in ("started", "first_token", "ended")
    )
    seconds = sum(end - start for start, end in spans)
    completed = _within(ended, spans)
    width = raw["token_bin_seconds"]
    bins = np.asarray(raw["token_bins"], np.int64)
    tokens = int(bins[_within((np.arange(len(bins)) + 0.5) * width, spans)].sum())
    return {
        "seconds": seconds,
        "requests_completed": int(completed.sum()),
        "requests_per_second": float(completed.sum() / seconds) if seconds else float("nan"),
        "tokens_per_second": tokens / seconds if seconds else float("nan"),
        "latency_ms": _percentiles_ms((ended - started)[completed]),
        "ttft_ms": _percentiles_ms((first - started)[_within(first, spans)]),
    }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def inference_figures(raw: dict[str, Any], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The load while shipping (the measured ship windows) against the load alone (the
    baseline), and what shipping kept of it."""
    if raw["baseline"] is None:
        raise ValueError("inference: the load has no baseline phase (it failed before shipping began)")
    baseline = phase_figures(raw, [tuple(raw["baseline"])])
    shipping = phase_figures(raw, windows)
    return {
        "concurrency": raw["spec"]["concurrency"],
        "baseline": baseline,
        "shipping": shipping,
        "throughput_kept": _ratio(shipping["requests_per_second"], baseline["requests_per_second"]),
        "token_throughput_kept": _ratio(shipping["tokens_per_second"], baseline["tokens_per_second"]),
        "latency_p50_inflation": _ratio(shipping["latency_ms"]["p50"], baseline["latency_ms"]["p50"]),
        "latency_p99_inflation": _ratio(shipping["latency_ms"]["p99"], baseline["latency_ms"]["p99"]),
        "ttft_p99_ms": shipping["ttft_ms"]["p99"],
        "ttft_p99_inflation": _ratio(shipping["ttft_ms"]["p99"], baseline["ttft_ms"]["p99"]),
        "requests_completed": len(raw["ended"]),
        "rollouts_kept": raw["rollouts_kept"],
    }
