"""Acceptance: real AdamW versions through a local store, bit-exact at every version."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.format.manifest import manifest_key, parse_latest
from deltastore.testing.synthetic import TINY, AdamWTrajectory

SCHEMA = Path(__file__).parent.parent / "manifests" / "schema" / "manifest.v1.schema.json"
VERSIONS = 6


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy()


def assert_bit_exact(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor] | None
) -> None:
    assert got is not None
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert np.array_equal(bits(got[name]), bits(t)), name


@pytest.fixture(scope="module")
def published(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """Publish VERSIONS versions of the tiny model; return the store and the trainer's states."""
    store = tmp_path_factory.mktemp("store")
    traj = AdamWTrajectory(TINY, lr=1e-6, seed=1)
    pub = Publisher(store, max_frame_bytes=256 << 10, max_object_bytes=1 << 20)
    states = [traj.bf16()]
    reports = [pub.publish(states[0], version=1)]
    for v in range(2, VERSIONS + 1):
        states.append(traj.step())
        reports.append(pub.publish(states[-1], version=v))
    assert [r.kind for r in reports] == ["anchor"] + ["delta"] * (VERSIONS - 1)
    for r in reports[1:]:
        assert 0 < r.changed_elements < r.total_elements
        assert r.payload_bytes < 0.03 * r.dense_bytes, (r.version, r.payload_ratio)
    return store, states


def test_model_is_big_enough() -> None:
    shapes = TINY.shapes()
    assert TINY.numel() >= 4_000_000 and len(shapes) >= 20
    assert max(np.prod(s) for s in shapes.values()) > 1_000_000


def test_long_lived_fresh_subscriber_follows_every_version(published) -> None:
    store, states = published
    sub = Subscriber(store, max_workers=3, max_inflight_bytes=512 << 10)
    for v, state in enumerate(states, start=1):
        report = sub.sync(v)
        assert sub.version == v == report.version
        assert report.applied == (v,)
        assert report.kind == ("anchor" if v == 1 else "delta")
        assert_bit_exact(state, sub.tensors)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", range(1, VERSIONS + 1))
def test_fresh_subscriber_bootstraps_and_replays(published, target: int) -> None:
    store, states = published
    sub = Subscriber(store)
    report = sub.sync(target)
    assert report.applied == tuple(range(1, target + 1))
    assert_bit_exact(states[target - 1], sub.tensors)  # type: ignore[arg-type]


def test_subscriber_attached_at_v1_applies_in_place(published) -> None:
    store, states = published
    mine = {n: t.clone() for n, t in states[0].items()}
    storage = {n: t.data_ptr() for n, t in mine.items()}
    sub = Subscriber(store, tensors=mine, version=1)
    for v in range(2, VERSIONS + 1):
        report = sub.sync(v)
        assert report.kind == "delta" and report.from_version == v - 1
        assert report.payload_bytes < 0.03 * report.dense_bytes
        assert_bit_exact(states[v - 1], mine)
    assert sub.tensors is mine
    assert {n: t.data_ptr() for n, t in mine.items()} == storage  # no reallocation: in place


def test_default_sync_goes_to_latest(published) -> None:
    store, states = published
    sub = Subscriber(store, tensors={n: t.clone() for n, t in states[1].items()}, version=2)
    assert sub.latest() == VERSIONS
    report = sub.sync()
    assert report.applied == tuple(range(3, VERSIONS + 1))
    assert_bit_exact(states[-1], sub.tensors)  # type: ignore[arg-type]
    assert sub.sync().kind == "none"


def test_manifests_validate_and_checksums_match(published) -> None:
    store, states = published
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for v, state in enumerate(states, start=1):
        doc = json.loads((store / manifest_key(v)).read_bytes())
        validator.validate(doc)
        assert doc["version"] == v
        for name, entry in doc["tensors"].items():
            raw = state[name].contiguous().view(torch.uint8).numpy().tobytes()
            assert entry["adler32"] == zlib.adler32(raw), name
            if v > 1:
                prev = states[v - 2][name].contiguous().view(torch.uint8).numpy().tobytes()
                assert entry["parent_adler32"] == zlib.adler32(prev), name


def test_latest_hint_names_newest_manifest(published) -> None:
    import hashlib

    store, _ = published
    latest = parse_latest((store / "LATEST").read_bytes())
    assert latest.version == VERSIONS
    body = (store / manifest_key(VERSIONS)).read_bytes()
    assert latest.sha256 == hashlib.sha256(body).hexdigest()
