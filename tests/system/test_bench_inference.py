"""The orchestrator loop's own inference traffic (`rlship bench loop --inference-concurrency`):
the mock inference server answering a plain HTTP client (the standard library's, not the
bench's aiohttp) as an OpenAI-compatible streaming server does, and the bench at a tiny size
reporting every placement's `inference` figures. No timing asserts but lower bounds (a
server that sends a token before it is due is wrong however loaded the machine is)."""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.commands.cli import main
from orchestrator.commands.produce import SyntheticWorkload
from tests.support.processes import python_command, wait_for

pytestmark = pytest.mark.timeout(240)

TTFT, TOKEN, CHUNK, SEED, SEQ_LEN = 0.3, 0.02, 4, 7, 256
EARLY = 0.002  # the clock's and the loop's rounding: a token may come this much before its time


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`rlship bench mock-inference` as a user starts it, on a free port."""
    port_file = tmp_path_factory.mktemp("mock-inference") / "port"
    command = python_command(
        *("bench", "mock-inference", "--port", "0", "--port-file", str(port_file)),
        *("--ttft-ms", str(TTFT * 1000), "--token-ms", str(TOKEN * 1000), "--chunk-tokens", str(CHUNK)),
        *("--seed", str(SEED), "--seq-len", str(SEQ_LEN)),
    )
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("the mock inference server's port", port_file.exists, timeout=60)
        yield int(port_file.read_text())
    finally:
        process.terminate()
        process.wait(10)


def post(port: int, path: str, body: Any) -> tuple[http.client.HTTPResponse, float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = time.monotonic()
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return connection.getresponse(), sent


def events(response: http.client.HTTPResponse) -> list[tuple[float, bytes]]:
    """The server-sent events' data, each with when it arrived, up to the end of the body."""
    out = []
    for line in iter(response.readline, b""):
        if line.startswith(b"data: "):
            out.append((time.monotonic(), line[len(b"data: ") :].strip()))
    return out


def test_streams_a_chat_completion_chunk_by_chunk(server: int) -> None:
    """The answer of 9 tokens (cut by max_tokens) comes as a first chunk of one token, then
    chunks of 4: [1, 4, 4], then [DONE]; tokens are named `token_id:N`, the prompt's ids come
    once, the usage and the finish reason with the last chunk; no chunk comes before its
    token is due (time to first token, then the time per token)."""
    response, sent = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 9},
    )
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    got = events(response)
    assert got[-1][1] == b"[DONE]"
    chunks = [(at, json.loads(data)) for at, data in got[:-1]]
    sizes = [len(chunk["choices"][0]["logprobs"]["content"]) for _, chunk in chunks]
    assert sizes == [1, 4, 4]
    assert [chunk["choices"][0]["finish_reason"] for _, chunk in chunks] == [None, None, "length"]
    assert ["prompt_token_ids" in chunk for _, chunk in chunks] == [True, False, False]
    assert [chunk["object"] for _, chunk in chunks] == ["chat.completion.chunk"] * 3
    assert chunks[0][1]["choices"][0]["delta"]["role"] == "assistant"
    ids = []
    for _, chunk in chunks:
        choice = chunk["choices"][0]
        named = [token["token"] for token in choice["logprobs"]["content"]]
        assert all(name.startswith("token_id:") for name in named)
        assert [int(name.split(":")[1]) for name in named] == choice["token_ids"]
        assert all(token["logprob"] <= 0 for token in choice["logprobs"]["content"])
        ids += choice["token_ids"]
    assert all(0 <= token < 151_936 for token in ids)
    prompt = chunks[0][1]["prompt_token_ids"]
    assert chunks[-1][1]["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 9,
        "total_tokens": len(prompt) + 9,
    }
    # Token k is due TTFT + k * TOKEN after the request; a chunk comes with its last token.
    last_token = [0, 4, 8]
    for (at, _), k in zip(chunks, last_token, strict=True):
        assert at - sent >= TTFT + k * TOKEN - EARLY, (k, at - sent)
    assert [at for at, _ in got] == sorted(at for at, _ in got)


def test_lengths_come_from_the_workload(tmp_path: Path) -> None:
    """A fresh server's answers, without max_tokens, have the prompt and answer lengths of the
    bench's workload with the same seed and sequence length, in order; a completion given a
    prompt of token ids keeps it, and answers whole without `stream`."""
    port_file = tmp_path / "port"
    command = python_command(
        *("bench", "mock-inference", "--port", "0", "--port-file", str(port_file)),
        *("--ttft-ms", "0", "--token-ms", "0", "--seed", str(SEED), "--seq-len", str(SEQ_LEN)),
    )
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("the mock inference server's port", port_file.exists, timeout=60)
        port = int(port_file.read_text())
        workload = SyntheticWorkload(seed=SEED, seq_len=SEQ_LEN)
        for _ in range(3):
            prompt_length, answer_length = workload.lengths()
            response, _ = post(port, "/v1/chat/completions", {"messages": [], "stream": True})
            chunks = [json.loads(data) for _, data in events(response)[:-1]]
            assert len(chunks[0]["prompt_token_ids"]) == prompt_length
            assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == answer_length
            assert len(chunks) == 1 + math.ceil((answer_length - 1) / 16)  # the default chunk
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        response, _ = post(port, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        whole = json.loads(response.read())
        assert whole["object"] == "text_completion" and whole["prompt_token_ids"] == [5, 6, 7]
        assert whole["choices"][0]["logprobs"]["tokens"] == [
            f"token_id:{t}" for t in whole["choices"][0]["token_ids"]
        ]
        assert whole["usage"]["completion_tokens"] == 2
        response, _ = post(port, "/v1/completions", {"max_tokens": 0})
        assert response.status == 400 and b"max_tokens" in response.read()
    finally:
        process.terminate()
        process.wait(10)


# -- the bench -----------------------------------------------------------------------------

PHASE_KEYS = {
    "seconds",
    "requests_completed",
    "requests_per_second",
    "tokens_per_second",
    "latency_ms",
    "ttft_ms",
}
INFERENCE_KEYS = {
    "concurrency",
    "baseline",
    "shipping",
    "shipping_period",
    "throughput_kept",
    "period_throughput_kept",
    "throughput_kept_counting_error",
    "token_throughput_kept",
    "latency_p50_inflation",
    "latency_p99_inflation",
    "ttft_p99_ms",
    "ttft_p99_inflation",
    "lag_ms",
    "baseline_lag_ms",
    "baseline_heartbeat_ms",
    "trainer_idle_seconds",
    "requests_completed",
    "rollouts_kept",
}
BASELINE_SECONDS = 2.0


@pytest.fixture(scope="module")
def bench_dir(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench's directory: its report `loop.json`, each placement's raw `logs/*/result.json`."""
    out = tmp_path_factory.mktemp("bench-inference") / "loop.json"
    argv = ["--rollouts", "32", "--seq-len", "512", "--ranks", "2", "--steps", "2", "--warmup-steps", "0"]
    argv += ["--timeout", "90", "--inference-concurrency", "64", "--inference-token-ms", "1"]
    argv += ["--inference-chunk-tokens", "32", "--inference-warmup-seconds", "1"]
    argv += ["--inference-baseline-seconds", str(BASELINE_SECONDS)]
    assert main(["bench", "loop", "--json", str(out), *argv]) == 0
    return out.parent


@pytest.fixture(scope="module")
def report(bench_dir: Path) -> dict[str, Any]:
    return json.loads((bench_dir / "loop.json").read_text())


def test_every_placement_probes_the_loops_lag_through_the_baseline(
    bench_dir: Path, report: dict[str, Any]
) -> None:
    """The loop's lag with the load alone, beside the ship windows': a 10 ms probe through the
    baseline (each observation a 10 ms sleep and its lag), its p99 and max in the report."""
    for name, placement in report["placements"].items():
        load = placement["inference"]
        raw = json.loads((bench_dir / "logs" / name / "result.json").read_text())["inference"]
        lag_alone = raw["baseline_lag_ms"]
        probed = len(lag_alone) * 0.01 + sum(lag_alone) / 1000  # the seconds the probe's sleeps took
        assert BASELINE_SECONDS / 2 <= probed <= load["baseline"]["seconds"] + 0.05, name
        assert len(lag_alone) <= load["baseline"]["seconds"] / 0.01 + 1, name
        assert load["baseline_lag_ms"]["max"] == max(lag_alone), name
        assert load["baseline_lag_ms"]["p99"] == pytest.approx(float(np.percentile(lag_alone, 99))), name


def test_every_placement_reports_its_inference_figures(report: dict[str, Any]) -> None:
    """Each placement's `inference`: requests completed in the baseline and while shipping,
    the shipping phase being the placement's measured ship windows, percentiles in order,
    the loop's lag and the trainer's idle time of those windows, one step of rollouts made
    from the answers."""
    assert report["steps_identical"] is True
    assert list(report["placements"]) == ["inline", "thread", "celery"]
    for name, placement in report["placements"].items():
        load = placement["inference"]
        assert set(load) == INFERENCE_KEYS, name
        assert load["concurrency"] == 64
        baseline, shipping = load["baseline"], load["shipping"]
        assert set(baseline) == set(shipping) == set(load["shipping_period"]) == PHASE_KEYS, name
        assert baseline["seconds"] >= BASELINE_SECONDS, name
        assert shipping["seconds"] == pytest.approx(sum(placement["ship_seconds"])), name
        windows = placement["windows"]  # the period: from the first measured cut to the last record
        period = load["shipping_period"]
        assert period["seconds"] == pytest.approx(windows[-1]["end"] - windows[0]["start"]), name
        assert period["requests_completed"] >= shipping["requests_completed"], name
        for phase in (baseline, shipping, load["shipping_period"]):
            assert phase["requests_per_second"] == pytest.approx(
                phase["requests_completed"] / phase["seconds"]
            )
        assert baseline["requests_completed"] > 0 and baseline["tokens_per_second"] > 0, name
        assert baseline["latency_ms"]["p99"] >= baseline["latency_ms"]["p50"] > 0, name
        assert baseline["ttft_ms"]["p99"] >= baseline["ttft_ms"]["p50"] > 0, name
        assert load["requests_completed"] >= baseline["requests_completed"] + shipping["requests_completed"]
        assert load["rollouts_kept"] == 32, name  # one step's worth, checked as a producer does
        assert load["trainer_idle_seconds"] == placement["idle_seconds"], name
        assert load["lag_ms"]["max"] == placement["lag_ms"]["max"], name
        assert load["baseline_heartbeat_ms"]["max"] >= load["baseline_heartbeat_ms"]["p99"] >= 0, name
        assert load["throughput_kept"] == pytest.approx(
            shipping["requests_per_second"] / baseline["requests_per_second"]
        )
    # The inline placement holds the loop through its windows but for a Redis write: what it
    # completes there is the backlog that write lets through, maybe none. The others do not.
    for name in ("thread", "celery"):
        load = report["placements"][name]["inference"]
        shipping = load["shipping"]
        assert shipping["requests_completed"] > 0, name
        assert shipping["latency_ms"]["p99"] >= shipping["latency_ms"]["p50"] > 0, name
        assert load["throughput_kept"] > 0 and load["token_throughput_kept"] > 0, name
        assert load["latency_p99_inflation"] > 0, name
        assert 0 < load["throughput_kept_counting_error"] < load["throughput_kept"], name
    goals = {goal["goal"] for goal in report["goals"]}
    assert {
        "celery inference throughput_kept >= 0.95",
        "celery inference request p99 inflation <= 1.1",
    } <= goals


def test_bad_inference_options_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad inference option stops the bench before it starts anything, in one line naming
    the option and the value."""
    bad = [
        ("--inference-concurrency", "0"),
        ("--inference-chunk-tokens", "0"),
        ("--inference-baseline-seconds", "0"),
        ("--inference-token-ms", "-1"),
    ]
    for option, value in bad:
        extra = [] if option == "--inference-concurrency" else ["--inference-concurrency", "64"]
        assert main(["bench", "loop", "--steps", "1", *extra, option, value]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and option in error and f"got {value}" in error, error
