"""Which checkpoint a job resumes from: the newest that verifies, or a refusal when none does.

A directory whose checkpoints are all damaged holds progress a silent start from step 0 would
lose (and whose higher step numbers would outrank every new save), so the job stops and says so,
unless the user asks to start fresh (`start_fresh=True`, `HETRAIN_START_FRESH=1`,
`hetrain launch --start-fresh`). Damaged checkpoints are then set aside, never deleted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hetrain.checkpoint import store
from hetrain.checkpoint.errors import CheckpointError, describe_os_error, os_read_fix
from hetrain.checkpoint.manifest import Manifest, NewerManifestError, check_layout, read_manifest, verify
from hetrain.vocabulary import Env

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_SHOWN = 2  # damaged checkpoints named with their reason in the one-line refusal


def start_fresh_from_env() -> bool:
    """HETRAIN_START_FRESH as a bool; an unrecognised value is an error, not a guess."""
    value = os.environ.get(Env.START_FRESH, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CheckpointError(f"{Env.START_FRESH}={os.environ[Env.START_FRESH]!r}: expected 1 (start from step 0 "
                          f"when no checkpoint verifies) or 0; set it to 1 or 0")


def inspect(path: Path, step: int | None) -> tuple[str | None, Manifest | None]:
    """(None, manifest) when the checkpoint at `path` is whole; else (the reason, None). Hashes every file.

    A file that cannot be read (another user's) is no damage: CheckpointError names it, and the job stops."""
    try:
        manifest = read_manifest(path)
        reason = check_layout(path, manifest, step) or verify(path, manifest)
    except NewerManifestError as e:   # not damaged: set aside and passed over, a newer hetrain could not find it
        raise CheckpointError(f"checkpoint {path}: {e}; resume it with the hetrain version that wrote it, "
                              f"or give another checkpoint directory") from None
    except ValueError as e:
        return str(e), None
    except OSError as e:
        raise CheckpointError(f"cannot read {e.filename or path} while looking for checkpoints in {path.parent} "
                              f"({describe_os_error(e)}); {os_read_fix(e)}") from None
    return (reason, None) if reason is not None else (None, manifest)


@dataclass
class Choice:
    """What `choose` found in a checkpoint directory."""

    chosen: Path | None = None
    manifest: Manifest | None = None
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    """Checkpoints newer than the chosen one (all, when none is chosen) that do not verify, with why."""
    unfinished: list[Path] = field(default_factory=list)
    """Interrupted saves (`.tmp-step-N`) newer than the chosen checkpoint."""


def choose(root: Path) -> Choice:
    """The newest checkpoint under `root` that verifies, and what was passed over on the way to it."""
    choice = Choice()
    for step, path in store.committed(root):
        reason, manifest = inspect(path, step)
        if reason is None:
            choice.chosen, choice.manifest = path, manifest
            break
        choice.damaged.append((path, reason))
    chosen_step = -1 if choice.chosen is None else store.step_of(choice.chosen)
    for entry in sorted(root.glob(f"{store.TMP_PREFIX}*")):
        suffix = entry.name[len(store.TMP_PREFIX):]
        if suffix.isdigit() and int(suffix) > chosen_step:
            choice.unfinished.append(entry)
    return choice


def refusal(root: Path, damaged: list[tuple[Path, str]]) -> str:
    """The one line that stops a job whose every checkpoint is damaged."""
    shown = "; ".join(f"{path.name}: {reason}" for path, reason in damaged[:_SHOWN])
    more = f"; and {len(damaged) - _SHOWN} more" if len(damaged) > _SHOWN else ""
    return (f"no checkpoint in {root} verifies ({len(damaged)} damaged: {shown}{more}); resuming is impossible and "
            f"starting over would discard them: repair or move them away, or set {Env.START_FRESH}=1 (hetrain "
            f"launch --start-fresh) to start from step 0 and keep them as {store.DAMAGED_PREFIX}step-*")
