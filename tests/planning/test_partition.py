"""The split by device kind and the layer partition are exact: checked against brute force."""

import itertools
import math
import random

from hetrain.hardware.cluster import cluster_from_devices
from hetrain.planning.batch_split import FunctionCost, split_min_max
from hetrain.planning.cost_model import default_calibration
from hetrain.planning.partition import partition_blocks
from hetrain.planning.planner import kinds_of, max_micro_batch
from hetrain.workload import get_profile


def _brute(total, fns):
    best = float("inf")
    for shares in itertools.product(range(total + 1), repeat=len(fns) - 1):
        last = total - sum(shares)
        if last < 0:
            continue
        best = min(best, max(f(n) for f, n in zip(fns, (*shares, last))))
    return best


def test_one_split_over_device_kinds_matches_brute_force_on_planner_time_functions():
    rng = random.Random(0)
    names = ["a100", "v100", "t4", "l4", "h100", "a10"]
    calib = default_calibration()
    for trial in range(12):
        picked = rng.sample(names, 3)
        counts = [rng.randint(1, 2) for _ in picked]
        cluster = cluster_from_devices(",".join(f"{n}:{c}" for n, c in zip(picked, counts)))
        profile = get_profile(rng.choice(["resnet50", "bert-base", "resnet152"]))
        total = rng.randint(sum(counts), 24)
        kinds = kinds_of(cluster, profile, "auto", calib)
        mbs = [max(1, min(rng.randint(1, 6), max_micro_batch(profile, k, "adamw", 0, 1, False, total))) for k in kinds]
        costs = [FunctionCost(lambda n, k=k, mb=mb: k.time(n, mb, False)) for k, mb in zip(kinds, mbs)]
        shares = split_min_max(total, costs, counts=[k.count for k in kinds])
        fns = [c.time for c, k in zip(costs, kinds) for _ in range(k.count)]
        groups, start = [], 0
        for k in kinds:
            groups.append(shares[start:start + k.count])
            start += k.count
        assert sum(shares) == total
        assert all(max(g) - min(g) <= 1 for g in groups), groups  # a kind's devices differ by at most one
        got = max(f(n) for f, n in zip(fns, shares))
        best = _brute(total, fns)
        assert got <= best * 1.01, (trial, got, best)
        # the same split, device by device, without counts
        ref = split_min_max(total, [FunctionCost(f) for f in fns])
        assert math.isclose(got, max(f(n) for f, n in zip(fns, ref)), rel_tol=1e-9)


def test_one_split_exact_on_step_functions():
    rng = random.Random(1)
    for _ in range(30):
        costs, counts = [], []
        for _ in range(rng.randint(1, 3)):
            fixed, per, mb = rng.uniform(0, 2), rng.uniform(0.1, 3), rng.randint(1, 4)
            costs.append(FunctionCost(lambda n, f=fixed, p=per, m=mb: math.ceil(n / m) * f + n * p if n else 0.0))
            counts.append(rng.randint(1, 2))
        total = rng.randint(0, 14)
        shares = split_min_max(total, costs, counts=counts)
        fns = [c.time for c, n in zip(costs, counts) for _ in range(n)]
        got = max(f(n) for f, n in zip(fns, shares))
        assert sum(shares) == total
        assert got <= _brute(total, fns) * 1.01 + 1e-12


def test_partition_blocks_matches_brute_force():
    rng = random.Random(2)
    for _ in range(25):
        n, p = rng.randint(2, 8), rng.randint(1, 4)
        if p > n:
            continue
        w = [rng.uniform(0.5, 3) for _ in range(n)]
        speed = [rng.uniform(0.5, 2) for _ in range(p)]
        cap = [rng.uniform(2, 12) for _ in range(p)]
        t = lambda j, a, b: sum(w[a:b]) / speed[j]
        fits = lambda j, a, b: sum(w[a:b]) <= cap[j]
        got = partition_blocks(n, p, t, fits)
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = list(zip((0, *cuts), (*cuts, n)))
            if all(fits(j, a, b) for j, (a, b) in enumerate(bounds)):
                v = max(t(j, a, b) for j, (a, b) in enumerate(bounds))
                best = v if best is None else min(best, v)
        if best is None:
            assert got is None
        else:
            bounds, value = got
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(p - 1))
            assert math.isclose(value, best, rel_tol=1e-12)


def test_partition_blocks_with_a_least_stage_size_matches_brute_force():
    """Interleaved stages hold at least one block per chunk: `min_size` bounds every stage, and the
    pruned search still finds the min-max partition among those that fit."""
    rng = random.Random(5)
    checked = 0
    for _ in range(60):
        n, p, k = rng.randint(2, 12), rng.randint(1, 4), rng.randint(1, 3)
        w = [rng.uniform(0.5, 3) for _ in range(n)]
        speed = [rng.uniform(0.5, 2) for _ in range(p)]
        cap = [rng.uniform(2, 14) for _ in range(p)]
        t = lambda j, a, b: sum(w[a:b]) / speed[j]
        fits = lambda j, a, b: sum(w[a:b]) <= cap[j]
        got = partition_blocks(n, p, t, fits, min_size=k)
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = list(zip((0, *cuts), (*cuts, n)))
            if all(b - a >= k and fits(j, a, b) for j, (a, b) in enumerate(bounds)):
                v = max(t(j, a, b) for j, (a, b) in enumerate(bounds))
                best = v if best is None else min(best, v)
        if best is None:
            assert got is None
            continue
        checked += 1
        bounds, value = got
        assert all(b - a >= k for a, b in bounds) and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(fits(j, a, b) for j, (a, b) in enumerate(bounds))
        assert math.isclose(value, best, rel_tol=1e-12)
    assert checked >= 20
