"""Where a model's repeated layers are: the blocks activation checkpointing recomputes, FSDP2 wraps, and a
profile times one by one.

`find_blocks` is the layer stack itself; `profile_blocks` is the whole model cut around it, in the
order the modules were registered (for the models hetrain profiles, the order a forward calls them):
what comes before the stack, each layer, what comes after.
"""

from __future__ import annotations

from torch import nn


def _layer_stack(model: nn.Module) -> tuple[str, nn.Module, list[nn.Module]] | None:
    """(its path, the container, its repeated layers): the first nn.ModuleList / nn.Sequential, in module order,
    with a run of two or more consecutive children of one type holding parameters (the longest run)."""
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        best: list[nn.Module] = []
        run: list[nn.Module] = []
        for child in module.children():
            run = run + [child] if run and type(run[0]) is type(child) else [child]
            if len(run) > len(best) and any(True for _ in child.parameters()):
                best = list(run)
        if len(best) >= 2:
            return path, module, best
    return None


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the first nn.ModuleList / nn.Sequential that has some: the longest run of
    two or more consecutive children of one module type holding parameters (all of a ModuleList of
    layers; the layers of an nn.Sequential(embedding, *layers, head), as a pipeline script builds)."""
    found = _layer_stack(model)
    return found[2] if found is not None else []


def profile_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the model cut around its layer stack: on the path from the model to the stack,
    each module's other children before and after it, the stack's children one by one (a ModuleList's
    items too). Without a stack, the model's direct children (ModuleLists opened)."""
    found = _layer_stack(model)
    if found is None or found[0] == "":
        return _children(model, "")
    path = found[0].split(".")
    blocks: list[tuple[str, nn.Module]] = []
    after: list[list[tuple[str, nn.Module]]] = []
    module, prefix = model, ""
    for part in path:
        names = [name for name, _ in module.named_children()]
        at = names.index(part)
        children = _children(module, prefix, names[:at])
        blocks += children
        after.append(_children(module, prefix, names[at + 1:]))
        module, prefix = getattr(module, part), f"{prefix}{part}."
    blocks += _children(module, prefix)
    for rest in reversed(after):
        blocks += rest
    return blocks


def _children(module: nn.Module, prefix: str, only: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """Direct children named `prefix + name` (those in `only`, when given), a ModuleList opened into its
    items (it is never called itself); the module itself when it has none."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if only is not None and name not in only:
            continue
        if isinstance(child, nn.ModuleList):
            out.extend((f"{prefix}{name}.{i}", sub) for i, sub in enumerate(child))
        else:
            out.append((f"{prefix}{name}", child))
    if not out and only is None:
        return [(prefix.rstrip(".") or "model", module)]
    return out
