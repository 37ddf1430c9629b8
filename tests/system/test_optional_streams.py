"""Every optional stream prime-rl's trainer consumes, from the producer API to the wire:
ce and ref-kl weights, token types, mm_kwargs (encoded tensors) and routed experts of
shape [tokens, layers, topk]. The payloads rlship writes are decoded with msgspec into
prime-rl-shaped structs and compared, sample by sample, with what the producer gave."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from orchestrator.commands.bench.encode import WireEncodedTensor, WireMicroBatch
from orchestrator.producer import RolloutProducer, RolloutRejected
from tests.support.factories import rollout
from tests.support.shiprun import open_policy_gate, ship, ship_settings
from transport.schema import EncodedTensor

pytestmark = pytest.mark.timeout(180)
STEPS = 2


def with_streams(index: int, record, arrays):
    """A rollout's arrays plus every optional stream; every third one has an image."""
    rng = np.random.default_rng(index)
    n = record.num_tokens
    arrays = dict(arrays)
    arrays["input_ids"] = rng.integers(0, 100_000, n)  # unique: finds the sample on the wire
    arrays["ce_weights"] = rng.random(n)
    arrays["ref_kl_weights"] = rng.random(n).astype(np.float32)
    arrays["mm_token_type_ids"] = rng.integers(0, 3, n)
    arrays["routed_experts"] = rng.integers(0, 64, (n, 3, 2)).astype(np.uint8)
    if index % 3 == 0:
        arrays["mm_kwargs"] = {
            "pixel_values": rng.random((index % 5 + 1, 4)).astype(np.float32),
            "image_grid_thw": EncodedTensor("int64", (1, 3), np.array([[1, 2, index]]).tobytes()),
        }
    return record, arrays


def test_every_optional_stream_reaches_the_wire_as_msgspec_reads_it(
    client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, transport="fs", trainers="external",
        batch_size=8, group_size=4, max_off_policy_steps=100,
    )  # fmt: skip
    open_policy_gate(settings)  # the files are read afterwards: no trainer announces a policy
    producer = RolloutProducer(client, run_id)
    produced = {}
    for g in range(STEPS * 2 + 2):
        group = [
            with_streams(g * 4 + i, *rollout(f"o{g}-{i}", f"o{g}", r, num_output_tokens=9 + g))
            for i, r in enumerate([1.0, 0.0, 1.0, 0.0])
        ]
        producer.produce(group)
        produced.update({tuple(arrays["input_ids"].tolist()): arrays for _, arrays in group})
    ship(settings, trainers=False, produce=False)

    seen = stacked = 0
    for path in sorted(Path(tmp_path, "rollouts").glob("step_*/rank_*.bin")):
        for mb in msgspec.msgpack.Decoder(list[WireMicroBatch]).decode(path.read_bytes()):
            start, images = 0, []
            experts = np.frombuffer(mb.routed_experts.data, mb.routed_experts.dtype)
            experts = experts.reshape(mb.routed_experts.shape)
            assert mb.routed_experts.shape[1:] == [3, 2]
            for length in mb.sequence_lengths:
                segment = slice(start, start + length)
                start += length
                arrays = produced.get(tuple(mb.input_ids[segment]))
                if arrays is None:
                    assert set(mb.env_names[segment]) == {"padding"}
                    assert mb.ce_weights[segment] == [0.0] * length
                    continue
                seen += 1
                assert mb.ce_weights[segment] == arrays["ce_weights"].tolist()
                assert mb.ref_kl_weights[segment] == arrays["ref_kl_weights"].astype(float).tolist()
                assert mb.mm_token_type_ids[segment] == arrays["mm_token_type_ids"].tolist()
                assert np.array_equal(experts[segment], arrays["routed_experts"])
                if "mm_kwargs" in arrays:
                    images.append(arrays["mm_kwargs"])
            if not images:
                assert mb.mm_kwargs is None
                continue
            stacked += len(images) > 1
            pixels = np.concatenate([image["pixel_values"] for image in images])
            assert mb.mm_kwargs["pixel_values"] == WireEncodedTensor(
                "float32", list(pixels.shape), pixels.tobytes()
            )
            grid = b"".join(image["image_grid_thw"].data for image in images)
            assert mb.mm_kwargs["image_grid_thw"] == WireEncodedTensor("int64", [len(images), 3], grid)
    assert seen == STEPS * settings.batch_size, "every shipped rollout found on the wire once"
    assert stacked, "some micro-batch stacked the images of several samples"


def test_a_malformed_stream_is_rejected_by_the_producer_naming_it(client, run_id):
    producer = RolloutProducer(client, run_id)
    record, arrays = rollout("bad", "g", 1.0)
    for name, value, message in [
        ("ce_weights", np.ones(3), r"ce_weights: length 3, expected 10"),
        ("ref_kl_weights", np.full(10, np.nan), r"ref_kl_weights: non-finite value nan"),
        ("mm_token_type_ids", np.ones(10), r"mm_token_type_ids: dtype float64, expected integers"),
        ("mm_kwargs", {"pixel_values": ["float32", [2], b"x"]}, r"mm_kwargs.data: length 1 does not match"),
    ]:
        with pytest.raises(RolloutRejected, match=message):
            producer.produce([(record, {**arrays, name: value})])
    assert not client.exists(producer.keys.rollout("bad"))
