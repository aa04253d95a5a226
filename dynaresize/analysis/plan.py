"""The switch plans of a run: `dynaresize-analyze plan RUN [ITERATION]`.

Each resize's plan is replayed from the run's table history with `dynaresize.plan.switchplan.plan`, the
function whose plan the runtime executed and the simulator priced: which operations, on which
ranks, critical or in the background, moving how many bytes. (A resumed run's engines restart
cold; the replay, which does not see where the run was resumed, may show them as restored.)
"""
from __future__ import annotations

import json
import os

from dynaresize.plan import switchplan
from dynaresize.plan.roles import RoleTable
from dynaresize.timeline.reader import read_arrays
from dynaresize.timeline.schema import TimelineError

from .load import parse_config


def switch_plans(path: str | os.PathLike) -> dict[int, switchplan.SwitchPlan]:
    """{iteration: the plan of the resize at its start} for every resize of the run."""
    attrs, data = read_arrays(path, ("iterations",))
    config = parse_config(str(attrs.get("config") or ""), path)
    staging, rollout = config.get("staging") or {}, config.get("rollout") or {}
    world = int(attrs["world_size"])
    hosts = json.loads(attrs.get("hostnames") or "[]") or ["localhost"] * world
    numel = int(attrs.get("priced_parameters", attrs.get("parameters", 0)))
    rows = {int(r["iteration"]): r for r in data["iterations"]}       # the last row of an iteration wins
    plans, parked, previous = {}, frozenset(), None
    for it in sorted(rows):
        row = rows[it]
        k, version = int(row["train_ranks"]), int(row["table_version"])
        colocated = int(row["train_ranks"]) + int(row["rollout_ranks"]) > world
        if previous is not None and not colocated and k != previous[0]:
            old, new = RoleTable.split(world, previous[0], previous[1]), RoleTable.split(world, k, version)
            plans[it] = switchplan.plan(
                old, new, parked=parked, numel=numel,
                transport=switchplan.transport(staging.get("transport", "auto"), hosts, max(old.num_train, k)),
                release_mode=rollout.get("release", "sleep"), staging_critical=bool(staging.get("critical", False)),
                sharding=(config.get("trainer") or {}).get("sharding", "optimizer"), hosts=hosts)
            parked = plans[it].parked_after
        previous = (k, version)
    return plans


def format_plans(path: str | os.PathLike, iteration: int | None = None) -> str:
    plans = switch_plans(path)
    if iteration is not None:
        if iteration not in plans:
            raise TimelineError(f"{path}: no resize at the start of iteration {iteration} "
                                f"(resizes at: {', '.join(map(str, plans)) or 'none'})")
        plans = {iteration: plans[iteration]}
    if not plans:
        return "no resizes in this run"
    return "\n\n".join(f"iteration {it}: {switchplan.format_plan(p)}" for it, p in plans.items())
