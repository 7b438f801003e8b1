"""The chain-link rule: whether a version applies to a state of its parent. Pure: no I/O.

A version names its parent by number and by content (``parent.version``,
``parent.state_digest``) and carries, per tensor, the Adler-32 of the parent's bytes
(``parent_adler32``). It *fits* a :class:`State` (a version's state digest, per-tensor
Adler-32 and, when known, tensor table) when

1. it names that state's version as its parent (:data:`PARENT_VERSION`);
2. its ``parent.state_digest`` is the state's digest (:data:`PARENT_DIGEST`);
3. a delta has the state's tensor table: names, dtypes, shapes (:data:`PARENT_TABLE`; checked
   only when the state's table is known; an anchor may change the table);
4. every tensor's ``parent_adler32`` is the state's Adler-32 of that tensor
   (:data:`PARENT_ADLER32`; tensors the state does not hold are not compared, nor are they
   when the tables differ; an anchor's null ``parent_adler32`` is not compared).

The same rule serves the planner of a sync (:meth:`deltastore.catalog.chain.ChainReader.plan`),
``deltastore verify`` (which reports every misfit as a problem of the same kind) and the
coordinator of a sharded publish (:func:`deltastore.publish.parts.commit_parts`). An anchor
applies to any state; its misfits are only reported by verify. Everything here is immutable
and thread-safe; the cost is O(tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from deltastore.format.manifest import Manifest, Parent, TensorEntry

#: The version has no parent, or names another version than the state's.
PARENT_VERSION: Final = "parent-version"
#: The version's ``parent.state_digest`` is not the state's digest.
PARENT_DIGEST: Final = "parent-digest"
#: A delta names other tensors (names, dtypes, shapes) than the state holds.
PARENT_TABLE: Final = "parent-table"
#: A tensor's ``parent_adler32`` is not the state's Adler-32 of that tensor.
PARENT_ADLER32: Final = "parent-adler32"

#: Tensor name -> (dtype name, shape).
Table = Mapping[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Misfit:
    """One way a version does not fit a state. ``kind`` is one of the ``PARENT_*`` names;
    ``message`` says what differs, with the version as its subject left out (``deltastore
    verify`` prints it after the version's key); ``tensors``: the tensors concerned (one for
    :data:`PARENT_ADLER32`, those that differ for :data:`PARENT_TABLE`, else none)."""

    kind: Literal["parent-version", "parent-digest", "parent-table", "parent-adler32"]
    message: str
    tensors: tuple[str, ...] = ()


def table_of_entries(tensors: Mapping[str, TensorEntry]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensor table of manifest entries: name -> (dtype name, shape)."""
    return {n: (e.dtype, tuple(e.shape)) for n, e in tensors.items()}


@dataclass(frozen=True)
class State:
    """A state of a version's tensors: ``version``, its ``digest`` (the manifest's
    ``state_digest``), per-tensor Adler-32 (``adler``) and the tensor table (``table``; None:
    unknown, not compared). The mappings are not copied: do not change them while the state
    is in use."""

    version: int
    digest: str
    adler: Mapping[str, int]
    table: Table | None = None

    @classmethod
    def of(cls, m: Manifest) -> State:
        """The state a version's manifest describes (with its table)."""
        return cls(
            m.version,
            m.state_digest,
            {n: e.adler32 for n, e in m.tensors.items()},
            table_of_entries(m.tensors),
        )

    def misfits(self, child: Manifest) -> list[Misfit]:
        """How ``child`` does not fit this state, in the order of the module docstring's
        rules (empty: it fits)."""
        return link_misfits(self, kind=child.kind, parent=child.parent, tensors=child.tensors)

    def fits(self, child: Manifest) -> bool:
        """Whether ``child`` applies to this very state (no misfit)."""
        return not self.misfits(child)


def link_misfits(
    state: State,
    *,
    kind: Literal["anchor", "delta"],
    parent: Parent | None,
    tensors: Mapping[str, TensorEntry],
) -> list[Misfit]:
    """How a version of ``kind`` on ``parent`` with ``tensors`` does not fit ``state`` (empty:
    it fits). For a version not yet built into a manifest (a sharded commit); else
    :meth:`State.misfits`. A wrong parent version is the only misfit then reported."""
    if parent is None:
        return [Misfit(PARENT_VERSION, f"has no parent, not version {state.version}")]
    if parent.version != state.version:
        return [
            Misfit(PARENT_VERSION, f"names parent {parent.version}, not version {state.version}")
        ]
    out: list[Misfit] = []
    if parent.state_digest != state.digest:
        out.append(
            Misfit(
                PARENT_DIGEST,
                f"names parent {state.version} with state digest {parent.state_digest[:16]}…, "
                f"the parent's is {state.digest[:16]}…",
            )
        )
    if state.table is not None:
        table = table_of_entries(tensors)
        if table != state.table:
            if kind == "delta":
                odd = sorted(set(table).symmetric_difference(state.table)) or sorted(
                    n for n in table if table[n] != state.table[n]
                )
                out.append(
                    Misfit(
                        PARENT_TABLE,
                        f"names other tensors, dtypes or shapes than its parent {state.version}",
                        tuple(odd),
                    )
                )
            return out  # the Adler-32 of tensors that changed shape mean nothing
    for name, e in tensors.items():
        held = state.adler.get(name)
        if held is None or (e.parent_adler32 is None and kind == "anchor"):
            continue
        if e.parent_adler32 != held:
            out.append(
                Misfit(
                    PARENT_ADLER32,
                    f"parent_adler32 {_hex(e.parent_adler32)}, the parent {state.version} says "
                    f"{held:08x}",
                    (name,),
                )
            )
    return out


def _hex(value: int | None) -> str:
    return "null" if value is None else f"{value:08x}"


__all__ = [
    "PARENT_ADLER32",
    "PARENT_DIGEST",
    "PARENT_TABLE",
    "PARENT_VERSION",
    "Misfit",
    "State",
    "Table",
    "link_misfits",
    "table_of_entries",
]
