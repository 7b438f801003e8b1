"""Every error type lives in ``deltastore.errors``, and each survives the trip from a vLLM
worker to the driver: raised on a worker, turned into plain values by ``error_to_dict`` (what
``collective_rpc`` carries), raised again by ``raise_for_error`` as the same type, with its
message and its keyword fields. No vLLM needed."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from deltastore import errors
from deltastore.engines.vllm import error_to_dict, raise_for_error
from deltastore.errors import DeltastoreError, EngineSyncError, StoreError
from tests.helpers import ThreadRanks

PACKAGE = Path(errors.__file__).resolve().parent
#: Classes deriving from an error of errors.py that stay where they are used: control flow
#: that never reaches a caller, and the fault a test tool injects.
ALLOWED_ELSEWHERE = {
    ("sync/fetch.py", "Cancelled"),
    ("testing/faults.py", "InjectedFault"),
}


def sample(cls: type[BaseException]) -> tuple[BaseException, dict[str, Any]]:
    """An instance of ``cls`` with a message and a value for each keyword-only argument of its
    constructor; the keyword values."""
    kwargs: dict[str, Any] = {}
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        hint = str(p.annotation)
        if isinstance(p.default, tuple) or "tuple" in hint:
            kwargs[p.name] = (f"{p.name}.a", f"{p.name}.b")
        elif isinstance(p.default, int) or hint in ("int", "int | None"):
            kwargs[p.name] = 12345
        elif isinstance(p.default, str) or "str" in hint:
            kwargs[p.name] = f"{p.name} value"
        else:  # pragma: no cover - a new constructor: teach this test a sample value
            pytest.fail(f"{cls.__name__}({p.name}=...): add a sample value for {hint}")
    return cls(f"{cls.__name__} happened: do this", **kwargs), kwargs


def on_worker(exc: BaseException) -> dict[str, Any]:
    """What a worker returns for ``exc``, after crossing a process boundary as JSON."""
    try:
        raise exc
    except Exception as caught:
        result = {"rank": 1, "ok": False, "error": error_to_dict(caught)}
    return dict(json.loads(json.dumps(result)))


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_type_round_trips_through_the_worker_result(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, DeltastoreError)
    exc, kwargs = sample(cls)
    result = on_worker(exc)
    assert result["error"]["type"] == name
    with pytest.raises(DeltastoreError) as info:
        raise_for_error([{"rank": 0, "ok": True, "error": None}, result])
    assert type(info.value) is cls, f"{name} came back as {type(info.value).__name__}"
    assert str(info.value) == f"rank 1: {name} happened: do this"
    for key, value in kwargs.items():
        assert getattr(info.value, key) == value, key


def test_table_changed_error_keeps_the_changed_names() -> None:
    exc = errors.TableChangedError("table changed", added=("x.weight",), reshaped=("y.bias",))
    with pytest.raises(errors.TableChangedError) as info:
        raise_for_error([on_worker(exc)])
    assert info.value.added == ("x.weight",) and info.value.reshaped == ("y.bias",)
    assert info.value.removed == () and info.value.retyped == ()


def test_a_private_subclass_comes_back_as_its_public_base() -> None:
    from deltastore.testing.faults import InjectedFault

    with pytest.raises(StoreError) as info:
        raise_for_error([on_worker(InjectedFault("put failed"))])
    assert type(info.value) is StoreError
    assert str(info.value) == "rank 1: InjectedFault: put failed"


def test_another_error_comes_back_as_engine_sync_error_with_its_name() -> None:
    with pytest.raises(EngineSyncError) as info:
        raise_for_error([on_worker(RuntimeError("boom"))])
    assert type(info.value) is EngineSyncError
    assert str(info.value) == "rank 1: RuntimeError: boom"


def test_a_result_without_error_raises_nothing() -> None:
    raise_for_error([{"rank": 0, "ok": True, "error": None}, {"rank": 1, "ok": True}])


def test_every_deltastore_error_is_defined_in_errors_py() -> None:
    """No module but errors.py defines a class deriving from one of its errors (the two
    exceptions above are not errors a caller sees), and errors.py lists each class it
    defines in ``__all__``."""
    public = set(errors.__all__)
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            if rel == "errors.py":
                assert node.name in public, f"errors.{node.name} is not in errors.__all__"
            elif bases & public and (rel, node.name) not in ALLOWED_ELSEWHERE:
                elsewhere.append(f"{rel}: {node.name}")
    assert not elsewhere, f"move these error classes to deltastore/errors.py: {elsewhere}"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("deltastore.format.signing", "SignatureError"),
        ("deltastore.checkpoint.safetensors", "CheckpointError"),
        ("deltastore.engines.vllm", "EngineSyncError"),
        ("deltastore.store.fsspec_store", "TransientError"),
    ],
)
def test_moved_errors_stay_importable_from_their_old_modules(module: str, name: str) -> None:
    import importlib

    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


# --- the ranks of an engine agree, and the driver raises the rank that failed -----------------


def agree_all(outcomes: list[BaseException | None]) -> list[BaseException | None]:
    """Every rank (a thread each) agrees with its outcome; what each one raised (or None)."""
    from concurrent.futures import ThreadPoolExecutor

    from deltastore.engines.worker_errors import agree

    group = ThreadRanks(len(outcomes))

    def one(r: int) -> BaseException | None:
        exc = outcomes[r]
        try:
            agree(group.view(r), None if exc is None else error_to_dict(exc))
        except BaseException as raised:
            return raised
        return None

    with ThreadPoolExecutor(len(outcomes)) as pool:
        return list(pool.map(one, range(len(outcomes))))


def test_agree_stops_the_ranks_that_succeeded_when_one_failed() -> None:
    got = agree_all([None, errors.LayoutError("rank 1's layout does not fit"), None])
    assert got[1] is None  # the failed rank reports its own error, not this one
    for r in (0, 2):
        assert isinstance(got[r], errors.RankError), got[r]
        assert "rank 1 of the engine failed (LayoutError on rank 1: rank 1's layout" in str(got[r])
        assert "changed nothing" in str(got[r])


def test_agree_returns_when_every_rank_succeeded() -> None:
    assert agree_all([None, None]) == [None, None]


def test_agree_in_a_group_of_one_is_local() -> None:
    from deltastore.engines.worker_errors import agree
    from deltastore.sync.group import Group

    agree(Group(None), None)
    agree(Group(None), error_to_dict(ValueError("mine")))  # its own error: reported by it


def test_the_rank_that_failed_is_raised_not_the_ranks_it_stopped() -> None:
    stopped = on_worker(errors.RankError("rank 1 of the engine failed"))
    stopped["rank"] = 0
    cause = on_worker(errors.IntegrityError("frame 3 of versions/00000000000000000005/a.dsz"))
    with pytest.raises(errors.IntegrityError, match=r"^rank 1: frame 3 of versions/"):
        raise_for_error([stopped, cause])
    with pytest.raises(errors.RankError, match=r"^rank 0: "):  # no other error: that one
        raise_for_error([stopped, {"rank": 1, "ok": True, "error": None}])


def test_a_failed_result_without_an_error_still_raises() -> None:
    with pytest.raises(EngineSyncError, match="rank 1: failed without an error"):
        raise_for_error([{"rank": 0, "ok": True}, {"rank": 1, "ok": False, "error": None}])


class _Recording:
    """A group of one that records what each agreement carried (None: success)."""

    def __init__(self) -> None:
        self.said: list[str | None] = []

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        self.said.append(json.loads(data)["type"] if data else None)
        return [data]


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("fails", ["before", "after", "never"])
def test_agreed_tells_the_other_ranks_once_at_the_right_point(after: bool, fails: str) -> None:
    """A failure before the collectives is told in the agreement the others wait in; one after
    them only with ``after`` (the caller agrees again); a success agrees once, before."""
    from deltastore.engines.worker_errors import agreed

    group = _Recording()

    def make(before_collectives: Any) -> str:
        if fails == "before":
            raise StoreError("no store")
        before_collectives()
        if fails == "after":
            raise StoreError("lost")
        return "bound"

    if fails == "never":
        assert agreed(group, make, after=after) == "bound"
    else:
        with pytest.raises(StoreError):
            agreed(group, make, after=after)
    expected = {
        "before": ["StoreError"],
        "after": [None, "StoreError"] if after else [None],
        "never": [None],
    }[fails]
    assert group.said == expected
