"""The switch plan on its own (pure): which operations, ranks, paths and bytes a resize takes. That
the runtime and the simulator follow it op by op: tests/test_resize.py."""
from __future__ import annotations

import numpy as np
import pytest

from dynaresize.plan import switchplan
from dynaresize.plan.roles import RoleTable

NUMEL = 1000


def ops(p) -> list[tuple]:
    return [(op.name, op.ranks, op.critical) for op in p.ops]


def test_growing_training_on_one_node_stages_through_files():
    old = RoleTable.split(8, 2, version=3)
    p = switchplan.plan(old, old.with_split(5), parked=frozenset(), transport="file", numel=NUMEL,
                        release_mode="sleep")
    assert ops(p) == [("commit", tuple(range(8)), True), ("group_switch", tuple(range(8)), True),
                      ("release", (2, 3, 4), True),
                      ("stage_out", (0, 1), False),                      # staying owners: background
                      ("weight_load", tuple(range(5)), True),            # broadcast to the new train set
                      ("stage_in", tuple(range(5)), False)]              # until the optimizer step
    assert p.new.version == 4 and p.parked_after == {2, 3, 4}
    stage_out, stage_in = p.ops[3], p.ops[5]
    assert stage_out.nbytes == (12 * 500,) * 2 and stage_in.nbytes == (12 * 200,) * 5
    assert p.ops[4].collective and p.ops[4].price == {"nbytes": 4 * NUMEL, "ranks": 5}


def test_shrinking_training_across_nodes_reshards_and_wakes_parked_engines():
    old = RoleTable.split(8, 5, version=4)
    hosts = ["a"] * 4 + ["b"] * 4
    assert switchplan.transport("auto", hosts, 5) == "network" and switchplan.transport("auto", hosts, 4) == "file"
    assert switchplan.transport("file", hosts, 5) == "file"                # a setting other than auto wins
    p = switchplan.plan(old, old.with_split(1), parked=frozenset({2, 3, 4}), transport="network", numel=NUMEL,
                        release_mode="sleep")
    assert ops(p) == [("commit", tuple(range(8)), True), ("group_switch", tuple(range(8)), True),
                      ("reshard", (0, 1, 2, 3, 4), True), ("engine_start", (1, 2, 3, 4), True),
                      ("weight_load", (1, 2, 3, 4), True)]
    engine_start = p.ops[3]
    assert engine_start.restored == (False, True, True, True)               # rank 1 never generated
    assert engine_start.price_for(1)["restore"] is False and engine_start.price_for(4)["restore"] is True
    # rank 0 keeps its range [0, 200) and receives the other four; each of them sends its own
    reshard = p.ops[2]
    assert reshard.nbytes == (12 * 800,) + (12 * 200,) * 4
    assert reshard.price == {"nbytes": 12 * 800, "ranks": 5, "messages": 4}
    assert p.parked_after == frozenset()


def test_leaving_ranks_spill_on_the_critical_path_and_critical_staging_is_a_baseline():
    old = RoleTable.split(4, 3)
    p = switchplan.plan(old, old.with_split(1), parked=frozenset(), transport="file", numel=NUMEL,
                        release_mode="teardown")
    assert [(op.name, op.ranks, op.critical) for op in p.ops if op.name.startswith("stage")] == [
        ("stage_out", (0,), False), ("stage_out", (1, 2), True), ("stage_in", (0,), False)]
    baseline = switchplan.plan(old, old.with_split(1), parked=frozenset(), transport="file", numel=NUMEL,
                               release_mode="teardown", staging_critical=True)
    assert all(op.critical for op in baseline.ops)


@pytest.mark.parametrize("k, k2", [(2, 5), (5, 2), (3, 7), (7, 3), (1, 1)])
def test_stage_in_waits_for_exactly_the_old_owners_of_its_range(k, k2):
    numel = 1001
    size_old, size_new = -(-numel // k), -(-numel // k2)
    for rank in range(k2):
        lo, hi = rank * size_new, min((rank + 1) * size_new, numel)
        owners = {q for q in range(k) if q * size_old < hi and min((q + 1) * size_old, numel) > lo}
        assert set(switchplan.sources(numel, k, k2, rank)) == owners


@pytest.mark.parametrize("k, k2", [(2, 5), (5, 2), (3, 7), (7, 3), (4, 4), (1, 6), (6, 1), (40, 56), (52, 6)])
def test_the_network_reshard_moves_each_range_once_and_no_rank_more_than_its_own(k, k2):
    numel = 100_003
    transfers = switchplan.reshard_transfers(numel, k, k2)
    for r in range(k2):                       # the new range: what r held of it, plus what it receives
        lo, hi = switchplan.shard_range(numel, k2, r)
        parts = [(a, b) for q, dst, a, b in transfers if dst == r]
        if r < k:
            q_lo, q_hi = switchplan.shard_range(numel, k, r)
            if max(lo, q_lo) < min(hi, q_hi):
                parts.append((max(lo, q_lo), min(hi, q_hi)))
        parts.sort()
        assert parts[0][0] == lo and parts[-1][1] == hi and all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
    for q, dst, a, b in transfers:            # from the rank that holds it, never to itself
        q_lo, q_hi = switchplan.shard_range(numel, k, q)
        assert q != dst and q_lo <= a < b <= q_hi
    moved, messages = switchplan.reshard_load(numel, k, k2)
    most = 12 * max(-(-numel // k), -(-numel // k2))
    assert len(moved) == max(k, k2) and max(moved) <= most
    # against broadcasting every shard to every rank of the block (12 bytes a parameter to all)
    assert max(moved) < 12 * numel or min(k, k2) == 1
    assert messages == max(sum(1 for t in transfers if r in t[:2]) for r in range(max(k, k2)))
    # NCCL: a group's first batched point-to-point call must include every rank of the group
    takes_part = {r for t in transfers for r in t[:2]}
    assert takes_part == (set(range(max(k, k2))) if k != k2 else set())


# Toy prices: what each operation lasts, by name (engine_start: a wake-up, or a cold start).
PRICES = {"commit": 1.0, "group_switch": 0.0, "release": 4.0, "reshard": 3.0, "stage_out": 100.0,
          "stage_in": 100.0, "weight_load": 0.5}


def toy_time(name, restore=False, ranks=1, **_):
    if name == "engine_start":
        return 2.0 if restore else 10.0
    return PRICES[name] / 2 if name == "weight_load" and ranks > 1 else PRICES[name]


def test_the_critical_path_waits_for_collectives_and_hides_background_operations():
    old = RoleTable.split(8, 2)
    grow = switchplan.plan(old, old.with_split(5), parked=frozenset(), transport="file", numel=NUMEL,
                           release_mode="sleep")
    clock = np.zeros(8)
    steps = {op.name: (start, end) for op, start, end, _ in switchplan.walk(
        grow, clock, lambda op: toy_time(op.name, ranks=len(op.ranks)))}
    # the staying owners write in the background from the commit on; the broadcast starts when the
    # last joining rank has released its engine, and every member ends it together
    assert steps["stage_out"][0].tolist() == [1.0, 1.0] and steps["stage_out"][1].tolist() == [101.0, 101.0]
    assert steps["weight_load"][0].tolist() == [1.0, 1.0, 5.0, 5.0, 5.0]
    assert steps["weight_load"][1].tolist() == [5.25] * 5
    assert clock.tolist() == [5.25] * 5 + [1.0] * 3          # rollout ranks only committed
    assert switchplan.critical_time(grow, toy_time) == 5.25   # the staging is hidden
    # shrinking across nodes: the reshard, then rank 1's cold start (the others wake parked engines)
    shrink = switchplan.plan(RoleTable.split(8, 5), RoleTable.split(8, 5).with_split(1), parked=frozenset({2, 3, 4}),
                             transport="network", numel=NUMEL, release_mode="sleep")
    assert switchplan.critical_time(shrink, toy_time) == 1.0 + 3.0 + 10.0 + 0.5
    warm = switchplan.plan(RoleTable.split(8, 5), RoleTable.split(8, 5).with_split(2), parked=frozenset({2, 3, 4}),
                           transport="network", numel=NUMEL, release_mode="sleep")
    assert switchplan.critical_time(warm, toy_time) == 1.0 + 3.0 + 2.0 + 0.5


def test_format_plan_names_every_operation():
    old = RoleTable.split(4, 1)
    text = switchplan.format_plan(switchplan.plan(old, old.with_split(3), parked=frozenset(), transport="file",
                                                  numel=NUMEL, release_mode="sleep"))
    assert "1T/3R -> v1 3T/1R (file transport)" in text
    for name in ("commit", "group_switch", "release", "stage_out", "weight_load", "stage_in"):
        assert name in text


def test_full_sharding_across_nodes_sends_each_saved_file_to_the_nodes_that_read_it():
    # 2 -> 5 train ranks on nodes of 3: the save's 2 files (node a) go to node b, one to each of its
    # ranks in the block in turn; 5 -> 2: node a gets the 2 files written on b (ranks 3, 4), received
    # by ranks 0 and 1 in turn, and node b gets the 3 written on a, received by 3, 4, 3
    hosts = ["a"] * 3 + ["b"] * 3
    assert switchplan.file_routes(2, 5, hosts) == [(0, 3), (1, 4)]
    assert switchplan.file_routes(5, 5, hosts) == [(3, 0), (4, 1), (0, 3), (1, 4), (2, 3)]
    assert switchplan.file_routes(3, 3, hosts) == []                      # one node: nothing crosses
    old = RoleTable.split(6, 2)
    p = switchplan.plan(old, old.with_split(5), parked=frozenset(), transport="network", numel=NUMEL,
                        release_mode="sleep", sharding="full", hosts=hosts)
    assert ops(p) == [("commit", tuple(range(6)), True), ("group_switch", tuple(range(6)), True),
                      ("release", (2, 3, 4), True),
                      ("stage_out", (0, 1), True),                       # the old group saves (DCP)
                      ("reshard", tuple(range(5)), True),                # its files cross to node b
                      ("stage_in", tuple(range(5)), True)]               # the new group loads, resharded
    file_bytes = 12 * 500
    assert p.ops[4].nbytes == (file_bytes,) * 2 + (0,) + (file_bytes,) * 2
    assert p.ops[4].price == {"nbytes": file_bytes, "ranks": 5, "messages": 1}
    with pytest.raises(ValueError, match="nodes of ranks"):
        switchplan.plan(old, old.with_split(5), parked=frozenset(), transport="network", numel=NUMEL,
                        release_mode="sleep", sharding="full")
