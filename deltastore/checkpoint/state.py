"""The bookkeeping files of a checkpoint folder (sidecar, pending marker, staged switch), and
:class:`FolderRepair`, what a pull that repaired a folder found.

- ``.deltastore.json`` (the sidecar): the version the folder is at, its state digest and the
  Adler-32 of every tensor; replaced atomically after each version is written and flushed.
- ``.deltastore.pending`` (the marker): a pull that writes is under way (or was killed).
- ``.deltastore.next/`` (the staging folder): when a version changes the tensor table, its
  files are built and filled there, beside the folder's, with their own sidecar. Once they
  are complete and durable, the marker is rewritten with the list of new files (the commit
  point), then the files are moved into the folder, the files the new table does not use are
  removed, the staged sidecar replaces the folder's, and the staging folder and the marker are
  removed. :func:`finish_switch` does (or redoes) all of that after the commit point, and
  removes an unfinished staging folder before it: until the commit point the folder's own files
  were never touched. Every step is an idempotent rename or unlink.

No torch here: reading a folder's state needs none.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltastore.checkpoint.safetensors import INDEX_NAME, CheckpointError
from deltastore.errors import DiskFullError
from deltastore.store.space import human, no_room

SIDECAR = ".deltastore.json"
SIDECAR_FORMAT = 1
#: Present while a pull that writes is under way (and after one was killed).
PENDING = ".deltastore.pending"
#: Where the files of a new tensor table are built before they replace the folder's.
STAGING = ".deltastore.next"


@dataclass(frozen=True)
class FolderState:
    """Content of a folder's sidecar: the version it is at and its per-tensor Adler-32."""

    version: int
    state_digest: str
    adler32: dict[str, int]


def n_tensors(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def few_names(names: tuple[str, ...]) -> str:
    more = f", +{len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


@dataclass(frozen=True)
class FolderRepair:
    """What a pull found in a folder whose tensors were not all at its recorded version.

    ``found``: version -> tensors whose Adler-32 is that version's (the target included; a
    tensor unchanged across versions counts at the newest). ``rebuilt``: tensors at none of
    them (e.g. written halfway), rebuilt from ``anchor``.
    """

    recorded: int | None
    target: int
    found: dict[int, tuple[str, ...]]
    rebuilt: tuple[str, ...]
    anchor: int | None

    def summary(self) -> str:
        """One line, e.g. ``3 tensors at v7 advanced to v8, 1 tensor (w) inconsistent:
        rebuilt from anchor v5``."""
        parts = [
            f"{n_tensors(len(names))} at v{v} advanced to v{self.target}"
            for v, names in sorted(self.found.items())
            if v != self.target
        ]
        if self.found.get(self.target):
            parts.append(f"{n_tensors(len(self.found[self.target]))} already at v{self.target}")
        if self.rebuilt:
            parts.append(
                f"{n_tensors(len(self.rebuilt))} ({few_names(self.rebuilt)}) inconsistent: "
                f"rebuilt from anchor v{self.anchor}"
            )
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "recorded": self.recorded,
            "target": self.target,
            "found": {str(v): list(n) for v, n in sorted(self.found.items())},
            "rebuilt": list(self.rebuilt),
            "anchor": self.anchor,
        }


def read_state(dest: str | os.PathLike[str]) -> FolderState | None:
    """The folder's recorded state, or None when it has no sidecar."""
    path = Path(dest) / SIDECAR
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); pull into a new folder") from None
    try:
        if meta["format"] != SIDECAR_FORMAT:
            raise CheckpointError(f"{path} has format {meta['format']!r}; upgrade deltastore")
        return FolderState(int(meta["version"]), str(meta["state_digest"]), dict(meta["adler32"]))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path} is malformed; pull into a new folder") from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(folder: Path) -> None:
    """fsync every file of ``folder``, then the folder itself."""
    for child in folder.iterdir():
        if child.is_file():
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(folder)


def write_json(dest: Path, name: str, body: dict[str, Any]) -> None:
    """Replace ``dest/name`` atomically and durably (temp file, fsync, rename, fsync folder);
    temp files a killed writer left behind are removed first. On any error before the rename
    the temp file is removed and ``dest/name`` is unchanged; a full disk or quota raises
    :class:`~deltastore.errors.DiskFullError`."""
    for stale in dest.glob(f".{name}.*"):
        stale.unlink(missing_ok=True)
    data = json.dumps(body, indent=1).encode()
    tmp = dest / f".{name}.{uuid.uuid4().hex}"
    try:
        with no_room(dest, name, needed=len(data)):
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, dest / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest)


def no_room_to_switch(
    dest: Path, exc: DiskFullError, recorded: int | None, target: int
) -> DiskFullError:
    """The error for the files of a new tensor table that found no room in the staging
    folder beside the folder's (the folder unchanged)."""
    need = f"they need {human(exc.needed)}" if exc.needed is not None else "they need more"
    return DiskFullError(
        f"no space left in {dest}: version {target} has another tensor table, so its files "
        f"are built in {STAGING} beside the folder's before they replace them; {need}, "
        f"{human(exc.free)} free. Nothing was changed: the folder stays at version "
        f"{recorded}. Free space, or pull version {target} into a new folder on a disk "
        "with room",
        errno=exc.errno,
        filename=str(dest),
        needed=exc.needed,
        free=exc.free,
    )


def not_recorded(dest: Path, exc: DiskFullError, version: int) -> DiskFullError:
    """The error for a version written in place whose record found no room: the marker
    stays, so the next pull checks the files and records it."""
    return DiskFullError(
        f"{exc}. Version {version} is written in {dest} but not recorded ({PENDING} is "
        "left): once there is room, the next pull checks the files and records it",
        errno=exc.errno,
        filename=str(dest),
        needed=exc.needed,
        free=exc.free,
    )


def begin(dest: Path, recorded: int | None, target: int) -> None:
    """Create the marker that says a pull writing ``dest`` is under way."""
    write_json(dest, PENDING, {"format": SIDECAR_FORMAT, "from": recorded, "to": target})


def end(dest: Path) -> None:
    (dest / PENDING).unlink(missing_ok=True)


def _data_file(name: str) -> bool:
    return name.endswith(".safetensors") or name == INDEX_NAME


def commit_switch(dest: Path, recorded: int | None, target: int) -> None:
    """The commit point of a switch: the staging folder is complete and durable; from here
    on the folder is switched to it, by this pull or, if it is killed, by the next one."""
    files = sorted(p.name for p in (dest / STAGING).iterdir() if _data_file(p.name))
    body = {"format": SIDECAR_FORMAT, "from": recorded, "to": target, "switch": files}
    write_json(dest, PENDING, body)


def switch_files(dest: Path) -> list[str] | None:
    """The files of the switch the marker commits (:func:`commit_switch`), or None when no
    switch was committed (no marker, a marker of another kind, or not ours)."""
    try:
        body = json.loads((dest / PENDING).read_text())
    except (OSError, ValueError):  # no marker (or not ours): nothing was committed
        return None
    files = body.get("switch") if isinstance(body, dict) else None
    if not (
        isinstance(files, list)
        and all(isinstance(n, str) and _data_file(n) and Path(n).name == n for n in files)
    ):
        return None
    return files


def finish_switch(dest: Path) -> bool:
    """Complete a committed switch (see the module docstring), or remove the staging folder of
    one that was not committed. Returns whether a switch was completed."""
    stage = dest / STAGING
    files = switch_files(dest)
    if files is None:
        if stage.is_dir():
            shutil.rmtree(stage)
        return False
    for name in files:
        if (stage / name).exists():
            os.replace(stage / name, dest / name)
    for child in dest.iterdir():
        if child.is_file() and _data_file(child.name) and child.name not in files:
            child.unlink()
    fsync_dir(dest)
    if (stage / SIDECAR).exists():
        os.replace(stage / SIDECAR, dest / SIDECAR)
        fsync_dir(dest)
    shutil.rmtree(stage, ignore_errors=True)
    end(dest)
    return True


__all__ = [
    "PENDING",
    "SIDECAR",
    "SIDECAR_FORMAT",
    "STAGING",
    "FolderRepair",
    "FolderState",
    "begin",
    "commit_switch",
    "end",
    "finish_switch",
    "fsync_files",
    "no_room_to_switch",
    "not_recorded",
    "read_state",
    "switch_files",
    "write_json",
]
