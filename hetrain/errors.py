"""Errors a user can hit. The CLI prints them as one line and exits non-zero."""

import difflib
from collections.abc import Hashable, Iterable, Sequence


class HetrainError(ValueError):
    """A problem with the user's input: the message names the value, the reason and the fix."""


class NoPlanFits(HetrainError):
    """No plan of the strategies asked for fits the model on the cluster's devices (the message says
    how short the memory is and what to add); `shortfall`: "DEVICE is N GB short", where known."""

    def __init__(self, message: str, shortfall: str | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall


def format_validation_error(e, model=None, kind: str | None = None) -> str:
    """A pydantic ValidationError as one readable line: where, and what is wrong. A field written wrong is
    both unknown and missing: where a part of the document has one of each, spelt alike, they are one fix
    naming both spellings; another unknown field is matched against the fields `model` (a pydantic model
    class, where given) allows at its place. A document that misses most of the fields `model` requires is
    said not to be `kind` (what it should be and what writes one), first."""
    errors = list(e.errors())
    missing_top = [err for err in errors if err["type"] == "missing" and len(err["loc"]) == 1]
    required = (model.model_json_schema().get("required", []) if model is not None else [])
    extra_top = [str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
    # a missing field an unknown one may be a misspelling of is not counted ("steps" and "notes" are spelt alike)
    unexplained = [err for err in missing_top
                   if not difflib.get_close_matches(str(err["loc"][0]), extra_top, n=1, cutoff=0.6)]
    if kind and len(unexplained) >= 2 and 2 * len(unexplained) >= len(required):
        return f"not {kind} (it lacks {', '.join(str(err['loc'][0]) for err in unexplained[:3])}" \
               + (f" and {len(unexplained) - 3} more" if len(unexplained) > 3 else "") + ")"
    schema = model.model_json_schema() if model is not None else None
    by_parent: dict[tuple, dict[str, list[int]]] = {}
    for i, err in enumerate(errors):
        by_parent.setdefault(tuple(err["loc"][:-1]), {}).setdefault(err["type"], []).append(i)
    renamed: dict[int, str] = {}   # an unknown field's error -> the missing field it is
    hidden: set[int] = set()       # the missing fields those renames account for
    for kinds in by_parent.values():
        extra, missing = kinds.get("extra_forbidden", []), kinds.get("missing", [])
        if len(extra) == 1 and len(missing) == 1 and difflib.get_close_matches(
                str(errors[extra[0]]["loc"][-1]), [str(errors[missing[0]]["loc"][-1])], n=1, cutoff=0.6):
            renamed[extra[0]] = str(errors[missing[0]]["loc"][-1])
            hidden.add(missing[0])
    parts = []
    for i, err in enumerate(errors):
        if i in hidden:
            continue
        where = ".".join(str(p) for p in err["loc"]) or "document"
        if err["type"] == "extra_forbidden":
            names = _names_at(schema, tuple(err["loc"][:-1])) if schema is not None else []
            close = difflib.get_close_matches(str(err["loc"][-1]), names, n=1, cutoff=0.75)
            target = renamed.get(i) or (close[0] if close else None)
            parts.append(f"{where}: unknown field; fix: "
                         + (f"rename it to {target!r}" if target else "remove it or correct its name"))
        else:
            parts.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    shown = 3   # a file of another kind altogether misses every field: the first few say so
    return "; ".join(parts[:shown]) + (f" (and {len(parts) - shown} more)" if len(parts) > shown else "")


def add_note(error: BaseException, note: str) -> None:
    """`error.add_note(note)` (Python 3.11), or the same `__notes__` list on 3.10, which hetrain's one-line
    reports read (3.10's traceback does not print it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]


def ranks_text(ranks: Iterable[int]) -> str:
    """`rank 3` or `ranks 0,2`: how a message names ranks."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def ranks_by_value(values: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Each distinct value of `values` (one per rank, by rank) and the ranks that hold it, in first-seen order."""
    groups: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def _names_at(schema: dict, loc: tuple) -> list[str]:
    """The field names a JSON schema allows at `loc` (keys and list indices from the document's root)."""
    node: object = schema
    for part in (*loc, None):
        while isinstance(node, dict):   # follow references and the first branch of a union with fields
            if "$ref" in node:
                node = schema.get("$defs", {}).get(node["$ref"].rsplit("/", 1)[-1], {})
            elif "anyOf" in node:
                node = next((b for b in node["anyOf"] if isinstance(b, dict) and b.get("type") != "null"), {})
            else:
                break
        if part is None or not isinstance(node, dict):
            break
        node = node.get("items", {}) if isinstance(part, int) else node.get("properties", {}).get(part, {})
    return sorted(node.get("properties", {})) if isinstance(node, dict) else []
