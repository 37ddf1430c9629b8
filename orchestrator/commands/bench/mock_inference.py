"""A mock inference server for `rlship bench loop --inference-concurrency`: OpenAI-compatible
HTTP on aiohttp, in a process of its own, standing in for the inference servers the
orchestrator's loop keeps requests in flight to.

`POST /v1/chat/completions` and `POST /v1/completions` answer as vLLM does with
`return_tokens_as_token_ids` and `return_token_ids`: each completion token is named
`token_id:N` in the logprobs, and the first chunk carries the prompt's token ids. With
`stream: true` the answer comes as server-sent events, chunk by chunk (`data: {...}`, then
`data: [DONE]`); without it, as one JSON body once the last token is due. Token k of an
answer is due `ttft + k * token_seconds` after the request arrived: the first chunk holds
the first token alone (the time to first token), each later one up to `chunk_tokens`.

Prompt and answer lengths are drawn from the bench's workload (`SyntheticWorkload.lengths`,
same seed and sequence length), an answer cut at the request's `max_tokens`; a prompt
given as token ids is taken as given. `GET /health` answers 200 once the server listens.

Started alone: `rlship bench mock-inference --port 8000` (or `python -m
orchestrator.commands.bench.mock_inference --port 8000`), then e.g.
`curl -N localhost:8000/v1/chat/completions -d '{"messages": [], "stream": true}'`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from orchestrator.commands.processes import ProcessGroup, rlship_command
from orchestrator.commands.produce import SyntheticWorkload

MODEL = "rlship-mock"
START_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class Pace:
    """How fast answers come: the time to first token, then a time per token, sent in chunks."""

    ttft_seconds: float
    token_seconds: float
    chunk_tokens: int

    def chunks(self, tokens: int) -> list[tuple[int, int, float]]:
        """Each chunk's tokens [start, stop) and when it is due after the request arrived: the
        first token alone at the time to first token, then up to `chunk_tokens` at a time."""
        bounds = [0, *range(1, tokens, self.chunk_tokens), tokens]
        return [
            (start, stop, self.ttft_seconds + (stop - 1) * self.token_seconds)
            for start, stop in itertools.pairwise(bounds)
        ]


class MockInference:
    """The server's state: the pace, the workload's lengths, a seeded stream of tokens."""

    def __init__(self, pace: Pace, seed: int, seq_len: int, vocab_size: int) -> None:
        self.pace = pace
        self.workload = SyntheticWorkload(seed=seed, seq_len=seq_len, vocab_size=vocab_size)
        self.rng = np.random.default_rng(seed + 1)
        self.vocab_size = vocab_size
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "requests": self.requests})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=False)

    def draw(self, body: dict[str, Any]) -> tuple[list[int], np.ndarray, np.ndarray, bool]:
        """The prompt's ids, the answer's ids and logprobs (lengths from the workload, cut at
        `max_tokens`), and whether it was cut."""
        prompt_length, answer_length = self.workload.lengths()
        given = body.get("prompt")
        is_ids = isinstance(given, list) and all(isinstance(t, int) for t in given)
        prompt = given if is_ids else self.tokens(prompt_length).tolist()
        max_tokens = body.get("max_tokens")
        max_tokens = answer_length if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise web.HTTPBadRequest(text=f"max_tokens: must be a positive integer (got {max_tokens!r})")
        tokens = min(answer_length, max_tokens)
        logprobs = -self.rng.exponential(0.7, tokens).astype(np.float32)
        return prompt, self.tokens(tokens), logprobs, tokens < answer_length

    def tokens(self, count: int) -> np.ndarray:
        return np.minimum(self.rng.zipf(1.3, count), self.vocab_size - 1)

    async def answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"request body: not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=f"request body: must be a JSON object (got {type(body).__name__})")
        self.requests += 1
        prompt, ids, logprobs, cut = self.draw(body)
        finish = "length" if cut else "stop"
        name = f"cmpl-{self.requests}"
        if not body.get("stream"):
            await asyncio.sleep(max(0.0, arrived + self.pace.chunks(len(ids))[-1][2] - time.monotonic()))
            choice = self.choice(chat, ids, logprobs, finish, first=True, whole=True)
            return web.json_response(self.message(name, chat, choice, prompt) | {"usage": usage(prompt, ids)})
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for index, (start, stop, due) in enumerate(self.pace.chunks(len(ids))):
            await asyncio.sleep(max(0.0, arrived + due - time.monotonic()))
            last = stop == len(ids)
            choice = self.choice(
                chat, ids[start:stop], logprobs[start:stop], finish if last else None, index == 0
            )
            chunk = self.message(name, chat, choice, prompt if index == 0 else None, stream=True)
            if last:
                chunk["usage"] = usage(prompt, ids)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def choice(
        chat: bool,
        ids: np.ndarray,
        logprobs: np.ndarray,
        finish: str | None,
        first: bool,
        whole: bool = False,
    ) -> dict[str, Any]:
        """A choice of the answer (`whole`) or of a chunk: its text, its tokens named by id
        with their logprobs, and the finish reason on the last; a chat's first says the role."""
        names = [f"token_id:{token}" for token in ids.tolist()]
        values = logprobs.tolist()
        text = " x" * len(names)
        if chat:
            content = {"role": "assistant", "content": text} if first else {"content": text}
            return {
                "index": 0,
                "message" if whole else "delta": content,
                "logprobs": {
                    "content": [{"token": n, "logprob": v} for n, v in zip(names, values, strict=True)]
                },
                "finish_reason": finish,
                "token_ids": ids.tolist(),
            }
        return {
            "index": 0,
            "text": text,
            "logprobs": {"tokens": names, "token_logprobs": values},
            "finish_reason": finish,
            "token_ids": ids.tolist(),
        }

    @staticmethod
    def message(
        name: str, chat: bool, choice: dict[str, Any], prompt: list[int] | None, stream: bool = False
    ) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        message: dict[str, Any] = {
            "id": name,
            "object": f"{kind}.chunk" if stream and chat else kind,
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
        }
        if prompt is not None:
            message["prompt_token_ids"] = prompt
        return message


def usage(prompt: list[int], ids: np.ndarray) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }


def start_mock_inference(
    group: ProcessGroup, options: list[str], port_file: Path, timeout: float = START_TIMEOUT_SECONDS
) -> str:
    """Start the server in `group` (`options`: its command line's, less the port) on a free
    port; its URL once it answers. One that exits or stays silent fails here, naming its log."""
    port_file.unlink(missing_ok=True)
    command = rlship_command(
        "bench", "mock-inference", "--port", "0", "--port-file", str(port_file), *options
    )
    process = group.start("inference-server", command)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else "not listening"
            log = group.log_dir / "inference-server.log"
            raise RuntimeError(f"mock inference server {state} after {timeout:.0f} s; see {log}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{int(port_file.read_text())}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (see --port-file)")
    parser.add_argument("--port-file", type=Path, default=None, help="where the port listened on is written")
    parser.add_argument("--ttft-ms", type=float, default=100.0, help="time to first token")
    parser.add_argument("--token-ms", type=float, default=10.0, help="time per token after the first")
    parser.add_argument(
        "--chunk-tokens", type=int, default=16, help="tokens per streamed chunk (the first: 1)"
    )
    parser.add_argument("--seq-len", type=int, default=8192, help="the workload's sequence length (lengths)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (lengths, tokens)")
    parser.add_argument("--vocab-size", type=int, default=151_936)


def pace_of(args: argparse.Namespace) -> Pace:
    """The pace the arguments ask for; a bad one is named with its value."""
    for name, value in (("--ttft-ms", args.ttft_ms), ("--token-ms", args.token_ms)):
        if not value >= 0:
            raise SystemExit(f"rlship: {name}: must be >= 0 (got {value})")
    if args.chunk_tokens < 1:
        raise SystemExit(f"rlship: --chunk-tokens: must be >= 1 (got {args.chunk_tokens})")
    return Pace(args.ttft_ms / 1000.0, args.token_ms / 1000.0, args.chunk_tokens)


async def serve(args: argparse.Namespace) -> None:
    server = MockInference(pace_of(args), args.seed, args.seq_len, args.vocab_size)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096)
    await site.start()
    port = runner.addresses[0][1]
    if args.port_file is not None:
        temporary = args.port_file.with_suffix(".tmp")
        temporary.write_text(str(port))
        temporary.replace(args.port_file)
    print(f"mock inference: listening on http://{args.host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    pace_of(args)  # a bad pace fails before anything listens
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m orchestrator.commands.bench.mock_inference")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
