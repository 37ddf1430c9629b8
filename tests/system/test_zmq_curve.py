"""CURVE on the ZMQ transport (`--zmq-curve`), against real CURVE sockets, a real ZAP
authenticator, real Redis and the session's real workers: only the run's ranks receive its
steps or make the sender send; a peer without a run key (no CURVE, or a key pair the run
does not know) gets nothing, however it tries."""

from __future__ import annotations

import contextlib
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import zmq

from tests.support.processes import Workers, refused, rlship
from tests.support.shiprun import delivered, ship, ship_settings
from transport.prime_receivers import ZMQMicroBatchReceiver
from transport.zmq_curve import ClientKeys, MissingKey, client_keys, connect_as_client, make_keys, server_keys
from transport.zmq_receiver import ZMQReceiver
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair, ready_message

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"
WAIT = 30.0
QUIET_MS = 1000  # how long a peer that must receive nothing is watched after the sends


def stranger(server: bytes) -> ClientKeys:
    """A CURVE client's keys that name the run's server but are none of its ranks'."""
    public, secret = zmq.curve_keypair()
    return ClientKeys(public, secret, server)


@contextlib.contextmanager
def peers(
    ctx: zmq.Context, kind: int, port: int, keys: list[ClientKeys | None]
) -> Iterator[list[zmq.Socket]]:
    """Raw sockets connected to `port`, one per entry: without CURVE (None) or with the keys."""
    sockets = []
    try:
        for key in keys:
            sock = ctx.socket(kind)
            sock.linger = 0
            if key is not None:
                connect_as_client(sock, key)
            if kind == zmq.SUB:
                sock.subscribe(b"")  # every rank's steps
            sock.connect(f"tcp://{HOST}:{port}")
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    make_keys(tmp_path / "keys", 2)
    return tmp_path / "keys"


def test_only_the_runs_rank_receives(keys: Path) -> None:
    """Two peers without a run key and one with rank 0's (a control, connected with them)
    subscribe to everything; once the control's subscription is in, so would theirs be."""
    port, ctx = free_port_pair(), zmq.Context()
    server = server_keys(keys, 1)
    try:
        with (
            ZMQSender(HOST, port, 1, run_id="t", curve=server, send_timeout=WAIT) as sender,
            peers(ctx, zmq.SUB, port, [None, stranger(server.public), client_keys(keys, 0)]) as subs,
            ZMQReceiver(HOST, port, 0, run_id="t", next_step=0, curve=client_keys(keys, 0)) as rank,
        ):
            *eavesdroppers, control = subs
            assert sender.wait_ready(WAIT)
            deadline = time.monotonic() + WAIT
            while sender.subscribers(0) < 2 and time.monotonic() < deadline:
                sender.wait_ready(0.1)
            time.sleep(QUIET_MS / 1000)  # the eavesdroppers' handshakes, had they been admitted
            for step in range(5):
                sender.send(step, 0, b"step %d" % step)
            got = [rank.receive(WAIT) for _ in range(5)]
            assert [(g.step, bytes(g.payload)) for g in got if g] == [(s, b"step %d" % s) for s in range(5)]
            assert [control.poll(int(WAIT * 1000)) and control.recv_multipart()[1] for _ in range(5)] == [
                b"step %d" % s for s in range(5)
            ]
            assert [sock.poll(QUIET_MS) for sock in eavesdroppers] == [0, 0]
            assert sender.subscribers(0) == 2, "the eavesdroppers never subscribed"
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("forger", ["no-curve", "unknown-key"])
def test_a_forged_ready_makes_the_sender_send_nothing(keys: Path, forger: str) -> None:
    """Rank 0 is subscribed (with its own key) but has not announced READY; a READY forged
    from a socket without the rank's key must not let its step go."""
    port, ctx = free_port_pair(), zmq.Context()
    server = server_keys(keys, 1)
    forged_keys = None if forger == "no-curve" else stranger(server.public)
    try:
        with (
            ZMQSender(HOST, port, 1, run_id="t", curve=server, send_timeout=2.0) as sender,
            peers(ctx, zmq.SUB, port, [client_keys(keys, 0)]) as (subscribed,),
            peers(ctx, zmq.PUSH, port + 1, [forged_keys]) as (forged,),
        ):
            for message in (ready_message(0, "t"), b"0"):  # rlship's READY and a stock rank's
                with contextlib.suppress(zmq.Again):
                    forged.send(message, zmq.NOBLOCK)
            assert not sender.wait_ready(2.0, rank=0)
            assert sender.subscribers(0) == 1, "the rank's own subscription arrived"
            with pytest.raises(TimeoutError, match="not ready"):
                sender.send(0, 0, b"step 0")
            assert subscribed.poll(QUIET_MS) == 0
            # The rank's own READY, with its key, is heard: the barrier above was CURVE's.
            with peers(ctx, zmq.PUSH, port + 1, [client_keys(keys, 0)]) as (own,):
                own.send(ready_message(0, "t"))
                sender.send(0, 0, b"step 0")
                assert subscribed.poll(int(WAIT * 1000)) and subscribed.recv_multipart()[1] == b"step 0"
    finally:
        ctx.destroy(linger=0)


def test_prime_rl_shaped_receiver_connects_with_the_run_keys(
    keys: Path, redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ZMQMicroBatchReceiver` takes CURVE from the environment rlship passes on."""
    port = free_port_pair()
    monkeypatch.setenv("RLSHIP_ZMQ_CURVE", "True")
    monkeypatch.setenv("RLSHIP_ZMQ_KEYS_DIR", str(keys))
    options = {"run_id": run_id, "redis_url": redis_url, "ranks": 1, "decode": bytes}
    transport = SimpleNamespace(host=HOST, port=port)
    with ZMQSender(HOST, port, 1, run_id=run_id, curve=server_keys(keys, 1), send_timeout=WAIT) as sender:
        receiver = ZMQMicroBatchReceiver("unused", 0, 1, transport, **options)
        try:
            assert sender.wait_ready(WAIT)
            sender.send(1, 0, b"payload")
            assert receiver.receive() == b"payload"
        finally:
            receiver.close()
    (keys / "rank-0.key_secret").unlink()
    with pytest.raises(MissingKey, match=r"rank-0\.key_secret"):
        ZMQMicroBatchReceiver("unused", 0, 1, transport, **options)


def test_a_secret_readable_by_others_is_refused(keys: Path) -> None:
    (keys / "server.key_secret").chmod(0o640)
    with pytest.raises(MissingKey, match="readable by others: chmod 600"):
        server_keys(keys, 2)


def test_a_run_ships_every_step_to_its_ranks_and_nothing_to_anyone_else(
    client: redis.Redis, redis_url: str, run_id: str, workers: Workers, tmp_path: Path
) -> None:
    settings = ship_settings(run_id, redis_url, workers, tmp_path / "run", zmq_curve=True, steps=3)
    keys_dir = Path(str(settings.zmq_keys_dir))
    make_keys(keys_dir, settings.ranks)
    server = server_keys(keys_dir, settings.ranks).public
    ctx = zmq.Context()
    try:
        with peers(ctx, zmq.SUB, settings.zmq_port, [None, stranger(server)]) as eavesdroppers:
            result = ship(settings)
            assert result.summary["steps_shipped"] == 3
            _, counts = delivered(client, run_id, settings.ranks)
            assert {r: sorted(c) for r, c in counts.items()} == {0: [0, 1, 2], 1: [0, 1, 2]}
            assert all(n == 1 for c in counts.values() for n in c.values())
            assert [sock.poll(QUIET_MS) for sock in eavesdroppers] == [0, 0]
    finally:
        ctx.destroy(linger=0)


def test_rlship_keys_writes_private_secrets(tmp_path: Path) -> None:
    done = rlship("keys", "--run-id", "r1", "--ranks", "2", "--output-dir", str(tmp_path / "r1"))
    assert done.returncode == 0, done.stderr
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "r1" / "keys").iterdir()}
    assert files == {
        **{f"{name}.key_secret": 0o600 for name in ("server", "rank-0", "rank-1")},
        **{f"{name}.key": 0o644 for name in ("server", "rank-0", "rank-1")},
    }
    assert "made server, rank-0, rank-1" in done.stdout
    assert f"{tmp_path}/r1/keys/rank-1.key_secret: rank 1's host only" in done.stdout
    again = rlship("keys", "--run-id", "r1", "--ranks", "2", "--output-dir", str(tmp_path / "r1"))
    assert "made none; kept server, rank-0, rank-1" in again.stdout
    assert stat.S_IMODE((tmp_path / "r1" / "keys").stat().st_mode) == 0o700


@pytest.mark.parametrize("command", ["run", "orchestrate"])
def test_curve_with_stock_external_ranks_is_refused_in_one_line(command: str, tmp_path: Path) -> None:
    done = rlship(command, "--zmq-curve", "--trainers", "external", "--output-dir", str(tmp_path))
    refused(done, "zmq_curve", "--external-ranks rlship", "docs/trainers.md")
