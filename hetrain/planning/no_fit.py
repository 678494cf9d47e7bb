"""What a plan that fits nowhere says: the device, the GBs it misses, and what would fit."""

from __future__ import annotations

from hetrain.planning.kinds import Kind

GB = 1e9
# why a pipeline has no plan where more memory would not help (pipeline_planner gives them, advice here reads them)
ONE_BLOCK = "the profile has fewer than 2 blocks to place on stages"
MORE_STAGES = "more stages than the model's {blocks} blocks"


def devices_to_add(profile, kinds, best, optimizer, world, global_batch: int | None = None, limit: int = 4096) -> str:
    """How many more devices of the kind with the most room would let ZeRO-3 at micro-batch 1 fit every
    device (each holds 1/world of the state), or which kind never fits however many share it; and, where
    fewer devices of that kind alone would do, that too (the smaller cards are what needs the many)."""
    def fits(k: Kind, n: int) -> bool:
        return k.memory(profile, 1, optimizer=optimizer, zero=3, world=n, ckpt=True).total <= k.spec.memory_bytes

    def least(group: list[Kind], start: int) -> int:   # the least n >= start with every kind fitting over n
        lo, hi = start, start + limit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if all(fits(k, mid) for k in group) else (mid + 1, hi)
        return lo

    def batch(n: int) -> str:   # every rank reads part of each global batch
        return f", with a global batch of at least {n}" if global_batch is not None and global_batch < n else ""

    never = [k.spec.name for k in kinds if not fits(k, world + limit)]
    if never:
        return (f"the {' and '.join(never)} cannot hold micro-batch 1 however many devices share the model's "
                f"state (leave {'them' if len(never) > 1 else 'it'} out)")
    total = least(kinds, world + 1)
    # CPU ranks of one machine share its memory: more of them there hold no more, on other machines they do
    where = " on other machines (CPU ranks of one machine share its memory)" if best.spec.arch == "cpu" else ""
    advice = f"add {total - world} more {best.spec.name}{where} (ZeRO-3 over {total} devices fits{batch(total)})"
    alone = least([best], 1)
    if len(kinds) > 1 and alone < total:
        others = " and ".join(k.spec.name for k in kinds if k is not best)
        more = alone - len(best.ranks)
        count = f"{alone} {best.spec.name} in all" + (f" ({more} more)" if more > 0 else "")
        advice += f", or leave out the {others} and run {count} (ZeRO-3 over {alone} fits{batch(alone)})"
    return advice


def no_fit_message(profile, kinds, cands, strategy, optimizer, world, micro_batch,
                   global_batch: int | None = None) -> tuple[str, str | None]:
    """(the error, "DEVICE is N GB short" where even the least a plan needs does not fit)."""
    zero = 3 if world > 1 else 0   # one device has nothing to shard over
    need = {k.spec.name: k.memory(profile, 1, optimizer=optimizer, zero=zero, world=world, ckpt=True).total
            for k in kinds}
    best = max(kinds, key=lambda k: k.spec.memory_bytes - need[k.spec.name])
    # when no strategy fits (auto weighed them all), the device that cannot hold the least a data-parallel
    # plan needs is named: of a 3090 and a 3060, the 3060 (zero1 on the 3090, closest to fitting, said
    # nothing of it); a strategy asked for names its own shortfall below, unless even the best device misses
    short_kind = min(kinds, key=lambda k: k.spec.memory_bytes - need[k.spec.name]) if strategy == "auto" else best
    missing = need[short_kind.spec.name] - short_kind.spec.memory_bytes
    what = f"strategy {strategy}" if strategy != "auto" else "any strategy"
    if missing > 0:   # the least any plan needs: the candidates' own shortfalls say no more
        even = f"sharded over all {world} devices with ZeRO-3, " if world > 1 else "on its own, with "
        short = f"{short_kind.spec.name} is {missing / GB:.1f} GB short"
        return (f"model {profile.name!r} fits no plan with {what}: even {even}activation checkpointing and "
                f"micro-batch 1, {short}; {devices_to_add(profile, kinds, best, optimizer, world, global_batch)}, "
                "use devices with more memory, or a smaller model or sequence length"), short
    if strategy == "auto":   # the candidate closest to fitting says what is missing
        own = min((c for c in cands.values() if c.shortfall_bytes > 0), key=lambda c: c.shortfall_bytes, default=None)
    else:   # the strategy asked for says why it does not fit
        own = cands.get(strategy)
    detail = f" ({own.strategy}: {own.reason.removeprefix('does not fit: ')})" if own is not None and own.reason else ""
    fits = max((c for c in cands.values() if c.feasible), key=lambda c: c.samples_per_s, default=None)
    tries = [f"--strategy {fits.strategy} ({fits.samples_per_s:.1f} samples/s)"] if fits is not None else \
        ["--strategy auto (it also weighs pipelines)"] if strategy not in ("auto", "pipeline") else []
    # a data-parallel strategy takes --micro-batch as a cap; a pipeline's micro-batch must fit its stages
    tries += ["a smaller --micro-batch"] if micro_batch is not None and micro_batch > 1 and strategy in (
        "auto", "pipeline") else []
    blocks = len(profile.blocks)
    if own is not None and strategy != "auto" and own.reason == ONE_BLOCK:   # more memory would not help
        tries += ["a model whose profile has 2 or more blocks (its top-level children, a ModuleList's items)"]
    elif own is not None and strategy != "auto" and own.reason == MORE_STAGES.format(blocks=blocks):
        tries += [f"fewer devices (a stage each for at most {blocks} blocks)",
                  "a model whose profile has more blocks than stages"]
    else:
        tries += ["devices with more memory"]
    options = tries[0] if len(tries) == 1 else f"{', '.join(tries[:-1])} or {tries[-1]}"
    return f"model {profile.name!r} does not fit with {what}{detail}; try {options}", None
