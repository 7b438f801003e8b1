"""The least-privilege S3 policies of docs/stores.md, against a moto server that enforces IAM.

Each role runs with an IAM user whose only policy is the one the docs give (read from the
docs, so docs and test cannot drift): a trainer publishes signed versions, a rollout node
syncs them bit-exact and writes its lease, gc deletes old versions; each is refused, with a
``StoreError`` caused by S3's ``AccessDenied``, what its policy leaves out. An attacker allowed
to write data objects only (``versions/*``) changes a committed version's bytes: a reader that
trusts the trainer's public key gets an ``IntegrityError`` and keeps its tensors bit for bit.

What moto does not enforce (measured in :func:`test_what_moto_does_not_enforce`): S3 condition
keys (an ``s3:prefix`` condition allows every prefix), and the 403 AWS S3 gives a caller without
``s3:ListBucket`` for a key that does not exist (moto answers 404).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from deltastore import AccessDeniedError, Publisher, Subscriber
from deltastore.errors import IntegrityError, StoreError
from deltastore.format.keys import LATEST_KEY, anchor_key, data_prefix, lease_key, manifest_key
from deltastore.format.signing import Ed25519Key
from deltastore.maintenance.retention import retain
from deltastore.store.s3 import S3Store
from deltastore.testing.synthetic import TINY, AdamWTrajectory
from tests.iam_moto import IamMoto, doc_policies, for_bucket, iam_moto

pytest.importorskip("s3fs")
pytest.importorskip("moto")

PREFIX = "policy"  # the docs' store prefix: the policies name it
VERSIONS = 3

#: Test only, not a role of the docs: may read the store and write data objects, nothing else.
ATTACKER = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::my-bucket"},
        {
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": "arn:aws:s3:::my-bucket/policy/*",
        },
        {
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": "arn:aws:s3:::my-bucket/policy/versions/*",
        },
    ],
}


class World:
    """A bucket holding the store ``s3://<bucket>/policy`` and one IAM user per role, each with
    the docs' policy for that bucket; storage options by role, and an admin store."""

    def __init__(self, server: IamMoto, policies: dict[str, dict[str, Any]]) -> None:
        self.bucket = f"iam-{uuid.uuid4().hex[:12]}"
        server.client("s3", server.admin).create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}/{PREFIX}"
        roles = {"trainer": "s3-trainer", "rollout": "s3-rollout", "gc": "s3-gc"}
        self.options = {
            role: server.user(f"{role}-{self.bucket}", for_bucket(policies[name], self.bucket))
            for role, name in roles.items()
        }
        self.options["attacker"] = server.user(
            f"attacker-{self.bucket}", for_bucket(ATTACKER, self.bucket)
        )
        self.admin = S3Store(self.url, server.admin)

    def store(self, role: str) -> S3Store:
        return S3Store(self.url, self.options[role])


@pytest.fixture(scope="module")
def server() -> Iterator[IamMoto]:
    with iam_moto() as s:
        yield s


@pytest.fixture(scope="module")
def policies() -> dict[str, dict[str, Any]]:
    found = doc_policies()
    assert {"s3-trainer", "s3-rollout", "s3-gc"} <= set(found), sorted(found)
    return found


@pytest.fixture
def world(server: IamMoto, policies: dict[str, dict[str, Any]]) -> World:
    return World(server, policies)


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    traj = AdamWTrajectory(TINY, lr=1e-6, seed=11)
    return [traj.bf16()] + [traj.step() for _ in range(VERSIONS)]


@pytest.fixture(scope="module")
def key() -> Ed25519Key:
    return Ed25519Key.generate("trainer")


def same_bits(a: dict[str, torch.Tensor], b: Any) -> bool:
    return set(a) == set(b) and all(
        np.array_equal(a[k].view(torch.int16).numpy(), b[k].view(torch.int16).numpy()) for k in a
    )


def refused(call: Any) -> StoreError:
    """Run ``call``; it must raise AccessDeniedError (a StoreError) caused by S3's
    AccessDenied, with a message that says what to do."""
    with pytest.raises(AccessDeniedError) as info:
        call()
    assert isinstance(info.value, StoreError) and "Least privilege" in str(info.value)
    cause = info.value.__cause__
    assert isinstance(cause, PermissionError), repr(cause)
    assert "AccessDenied" in repr(cause.__cause__) or "Access Denied" in str(cause), repr(cause)
    return info.value


def publish(world: World, key: Ed25519Key, states: list[dict[str, torch.Tensor]]) -> Publisher:
    pub = Publisher(world.url, storage_options=world.options["trainer"], signing_key=key)
    for v, state in enumerate(states, start=1):
        pub.publish(state, version=v)
    return pub


def test_roles_publish_sync_and_are_refused_the_rest(
    server: IamMoto,
    policies: dict[str, dict[str, Any]],
    world: World,
    key: Ed25519Key,
    states: list[dict[str, torch.Tensor]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    publish(world, key, states[:VERSIONS])
    admin = world.admin
    assert admin.list("_probe/") == []  # the probe object was removed (DeleteObject _probe/*)
    assert json.loads(admin.get(LATEST_KEY))["version"] == VERSIONS  # LATEST created, moved
    sub = Subscriber(
        world.url,
        storage_options=world.options["rollout"],
        trusted_keys=[key.public_key()],
        reader_id="rollout-1",
    )
    assert sub.sync().version == VERSIONS
    assert same_bits(states[VERSIONS - 1], sub.tensors)
    assert admin.list("leases/") == [lease_key("rollout-1")]  # the lease was written
    sub.close()
    assert admin.list("leases/") == []  # and removed (HeadObject + DeleteObject leases/*)

    no_lease = dict(policies["s3-rollout"])
    no_lease["Statement"] = [s for s in no_lease["Statement"] if "leases/" not in str(s)]
    options = server.user(f"nolease-{world.bucket}", for_bucket(no_lease, world.bucket))
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        sub = Subscriber(world.url, storage_options=options, trusted_keys=[key.public_key()])
        assert sub.sync().version == VERSIONS  # a refused lease write: leases off, a warning
        sub.close()  # waits for the lease write
    assert same_bits(states[VERSIONS - 1], sub.tensors)
    assert "leases off" in caplog.text and admin.list("leases/") == []

    reader = world.store("rollout")
    new = manifest_key(VERSIONS + 1)
    refused(lambda: reader.put_if_absent(new, b"{}"))
    refused(lambda: reader.put(f"{data_prefix(VERSIONS + 1)}x.dsz", b"data"))
    refused(lambda: reader.put(LATEST_KEY, b"{}"))
    refused(lambda: reader.put(anchor_key(VERSIONS), b"{}"))
    refused(lambda: reader.delete(manifest_key(1)))
    rogue = Publisher(world.url, storage_options=world.options["rollout"], signing_key=key)
    refused(lambda: rogue.publish(states[VERSIONS], version=VERSIONS + 1))  # the probe put

    trainer = world.store("trainer")
    refused(lambda: trainer.delete(manifest_key(1)))
    refused(lambda: trainer.delete(admin.list(data_prefix(1))[0]))
    refused(lambda: trainer.put(lease_key("rollout-1"), b"{}"))
    refused(lambda: world.store("gc").put(f"{data_prefix(9)}x.dsz", b"data"))
    assert admin.list(data_prefix(VERSIONS + 1)) == []
    assert admin.list("manifests/") == [manifest_key(v) for v in (1, 2, 3)]


def test_gc_deletes_and_the_others_cannot(
    world: World, key: Ed25519Key, states: list[dict[str, torch.Tensor]]
) -> None:
    pub = publish(world, key, states[: VERSIONS - 1])
    pub.publish(states[VERSIONS - 1], version=VERSIONS, anchor=True)  # old versions unneeded
    for role in ("trainer", "rollout"):
        refused(partial(retain, world.store(role), keep=1))
    assert world.admin.list("manifests/") == [manifest_key(v) for v in (1, 2, 3)]
    report = retain(world.store("gc"), keep=1)
    assert report.kept == (VERSIONS,)
    assert world.admin.list("manifests/") == [manifest_key(VERSIONS)]
    assert [k for k in world.admin.list("versions/") if not k.startswith(data_prefix(3))] == []
    sub = Subscriber(
        world.url,
        storage_options=world.options["rollout"],
        trusted_keys=[key.public_key()],
        lease_ttl=None,
    )
    assert sub.sync().version == VERSIONS
    assert same_bits(states[VERSIONS - 1], sub.tensors)


def flip_frame(world: World, manifest: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """Replace the bytes of the newest version's largest frame by others of the same length
    (attacker's credentials): the object's key, its bytes before and after."""
    frames = [f for t in manifest["tensors"].values() for f in t["frames"]]
    frame = max(frames, key=lambda f: f["length"])
    attacker = world.store("attacker")
    before = attacker.get(frame["object"])
    data = bytearray(before)
    span = slice(frame["offset"], frame["offset"] + frame["length"])
    data[span] = bytes(b ^ 0x5A for b in data[span])
    attacker.put(frame["object"], bytes(data))
    return str(frame["object"]), before, bytes(data)


def copy_older_object(world: World, manifest: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """Copy the data object of the version before over the newest one's (attacker's
    credentials): the object's key, its bytes before and after."""
    attacker = world.store("attacker")
    target = str(next(f for t in manifest["tensors"].values() for f in t["frames"])["object"])
    before = attacker.get(target)
    older = attacker.get(attacker.list(data_prefix(manifest["version"] - 1))[0])
    attacker.put(target, older)
    return target, before, older


@pytest.mark.parametrize("tamper", [flip_frame, copy_older_object], ids=["flip", "copy"])
def test_data_writer_cannot_change_a_readers_weights(
    world: World, key: Ed25519Key, states: list[dict[str, torch.Tensor]], tamper: Any
) -> None:
    pub = publish(world, key, states[: VERSIONS - 1])
    sub = Subscriber(
        world.url,
        storage_options=world.options["rollout"],
        trusted_keys=[key.public_key()],
        reader_id="rollout-held",
    )
    assert sub.sync().version == VERSIONS - 1
    held = {k: v.clone() for k, v in sub.tensors.items()}  # type: ignore[union-attr]
    assert same_bits(states[VERSIONS - 2], held)
    pub.publish(states[VERSIONS - 1], version=VERSIONS)

    attacker = world.store("attacker")
    body = attacker.get(manifest_key(VERSIONS))
    target, before, after = tamper(world, json.loads(body))
    assert before != after and world.admin.get(target) == after  # the attack landed
    older = attacker.get(manifest_key(VERSIONS - 1))
    refused(lambda: attacker.put(manifest_key(VERSIONS), older))  # replace a manifest
    refused(lambda: attacker.put_if_absent(manifest_key(VERSIONS + 1), body))  # commit one
    refused(lambda: attacker.put(LATEST_KEY, b"{}"))
    refused(lambda: attacker.put(anchor_key(VERSIONS), body))
    refused(lambda: attacker.delete(manifest_key(1)))
    assert world.admin.get(manifest_key(VERSIONS)) == body

    with pytest.raises(IntegrityError) as info:
        sub.sync()
    assert "BLAKE3" in str(info.value), str(info.value)
    assert sub.version == VERSIONS - 1
    assert same_bits(held, sub.tensors)
    fresh = Subscriber(
        world.url, storage_options=world.options["rollout"], trusted_keys=[key.public_key()]
    )
    with pytest.raises(IntegrityError):
        fresh.sync(VERSIONS)
    sub.close()


def test_what_moto_does_not_enforce(server: IamMoto) -> None:
    """Measured, so that a moto that starts enforcing these shows up here: a policy whose
    ``s3:ListBucket`` carries an ``s3:prefix`` condition lists other prefixes too, and a GET of
    a missing key by a user without ``s3:ListBucket`` answers 404 (AWS S3: 403)."""
    from botocore.exceptions import ClientError

    bucket = f"iam-{uuid.uuid4().hex[:12]}"
    admin = server.client("s3", server.admin)
    admin.create_bucket(Bucket=bucket)
    admin.put_object(Bucket=bucket, Key="other/x", Body=b"x")
    prefixed = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": f"arn:aws:s3:::{bucket}",
                "Condition": {"StringLike": {"s3:prefix": ["policy/*"]}},
            },
        ],
    }
    s3 = server.client("s3", server.user(f"cond-{bucket}", json.dumps(prefixed)))
    assert s3.list_objects_v2(Bucket=bucket, Prefix="other/")["KeyCount"] == 1  # AWS: denied
    get_only = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/*"}
        ],
    }
    s3 = server.client("s3", server.user(f"get-{bucket}", json.dumps(get_only)))
    with pytest.raises(ClientError) as info:
        s3.get_object(Bucket=bucket, Key="policy/LATEST")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"  # AWS S3: AccessDenied (403)
    with pytest.raises(ClientError) as info:
        s3.list_objects_v2(Bucket=bucket)
    assert info.value.response["Error"]["Code"] == "AccessDenied"  # enforced: no ListBucket
