"""`manifest.json`: what a complete checkpoint holds, with the size and sha256 of every file.

A checkpoint is trusted only as far as its manifest and its directory agree: the step matches the
directory's name, the files listed are exactly `shared.pt`, one rank file per rank of `world_size`
and (when sharded) DCP's files, and no other file lies in the directory. Then each file read is
checked against its size and sha256.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetrain.checkpoint.safe_io import sha256_file

FORMAT = "hetrain-checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARED_FILE = "shared.pt"
SHARDED_DIR = "sharded"
_SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"


def rank_file(rank: int) -> str:
    """The name of one rank's own file."""
    return f"rank-{rank:05d}.pt"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to its directory."""

    path: str
    bytes: int
    sha256: str


class NewerManifestError(ValueError):
    """A checkpoint written by a newer hetrain: whole, as far as this one can tell, and not this one's to read."""


@dataclass
class Manifest:
    """The written record that makes a checkpoint directory complete."""

    step: int
    world_size: int
    files: list[FileEntry]
    sharded: bool = False
    format: str = FORMAT
    version: int = VERSION
    created_unix: float = field(default_factory=time.time)

    @property
    def total_bytes(self) -> int:
        """Bytes of every file the manifest lists."""
        return sum(f.bytes for f in self.files)

    def to_json(self) -> str:
        """The manifest as JSON text."""
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse and check a manifest; ValueError with the reason when it is not one this version reads."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise NewerManifestError(f"manifest version {version}, written by a newer hetrain; this one reads "
                                     f"version {VERSION}")
        if version != VERSION:
            raise ValueError(f"manifest version {version!r}, this hetrain reads version {VERSION}")
        files = [FileEntry(str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in d["files"]]
        for f in files:
            if os.path.isabs(f.path) or ".." in Path(f.path).parts:
                raise ValueError(f"file path {f.path!r} leaves the checkpoint directory")
        if not isinstance(d["sharded"], bool):
            raise ValueError(f"sharded is {d['sharded']!r}, not true or false")
        return cls(
            step=int(d["step"]), world_size=int(d["world_size"]), files=files, sharded=d["sharded"],
            created_unix=float(d["created_unix"]),
        )


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest.json` into `directory` and fsync it."""
    path = directory / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest:
    """Read a directory's manifest; ValueError with the reason when missing or malformed."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ValueError("no manifest.json")
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, KeyError, TypeError, OverflowError) as e:   # (OverflowError: Infinity as a count)
        raise ValueError(f"manifest.json is malformed ({type(e).__name__}: {e})") from None


def check_layout(directory: Path, manifest: Manifest, step: int | None) -> str | None:
    """None when the manifest and the directory agree on what the checkpoint is; else the reason.

    `step` is the step the directory's name says (None to skip that check).
    """
    if step is not None and manifest.step != step:
        return f"manifest says step {manifest.step}, the directory says {step}"
    if manifest.world_size < 1:
        return f"manifest says world_size {manifest.world_size}"
    listed = [f.path for f in manifest.files]
    if len(set(listed)) != len(listed):
        return "manifest lists a file twice"
    names = set(listed)
    if SHARED_FILE not in names:
        return f"manifest does not list {SHARED_FILE}"
    ranks = {n for n in names if n.startswith("rank-")}
    if manifest.world_size > len(ranks):   # counted first: a damaged world_size of 10**9 makes no set of 10**9 names
        first = range(min(manifest.world_size, len(ranks) + 3))   # holds 3 missing names, or all there are
        missing = [name for name in map(rank_file, first) if name not in ranks]
        return (f"manifest says world_size {manifest.world_size} but lists {len(ranks)} rank files (lacks "
                f"{', '.join(missing)})")
    expected = {rank_file(r) for r in range(manifest.world_size)}
    if ranks != expected:
        missing, extra = sorted(expected - ranks), sorted(ranks - expected)
        what = f"lacks {', '.join(missing[:3])}" if missing else f"also lists {', '.join(extra[:3])}"
        return f"manifest says world_size {manifest.world_size} but {what}"
    sharded = {n for n in names if n.startswith(SHARDED_DIR + "/")}
    if manifest.sharded != (_SHARDED_METADATA in names) or (sharded and not manifest.sharded):
        return f"manifest says sharded={str(manifest.sharded).lower()} but lists {len(sharded)} sharded files"
    unknown = names - {SHARED_FILE} - ranks - sharded
    if unknown:
        return f"manifest lists {sorted(unknown)[0]}, which is no checkpoint file"
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST_NAME and rel not in names and not path.is_dir() and not path.name.startswith(".nfs"):
            return f"{rel} is in the directory but not in the manifest"
    return None


def verify(directory: Path, manifest: Manifest, only: set[str] | None = None) -> str | None:
    """None when every listed file (or those in `only`, each of which must be listed) has its size and
    sha256; else the reason."""
    unlisted = sorted((only or set()) - {entry.path for entry in manifest.files})
    if unlisted:
        return f"{unlisted[0]} is not in the manifest"
    for entry in manifest.files:
        if only is not None and entry.path not in only:
            continue
        path = directory / entry.path
        if not path.is_file():
            return f"{entry.path} is missing"
        size = path.stat().st_size
        if size != entry.bytes:
            return f"{entry.path} has {size} bytes, the manifest says {entry.bytes}"
        if sha256_file(path)[1] != entry.sha256:
            return f"{entry.path} does not match its sha256 in the manifest"
    return None

