"""plan.yaml: reading, checking and writing a ParallelPlan with its explicit rank map.

Every error names the file and the field (``ranks[3].node``, ``degrees.tp``, ...). A hand-written rank
map must agree with the one the degrees imply; a gap or overlap is named.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from adapt.errors import PlanError
from adapt.fileio import read_yaml
from adapt.plan import ParallelPlan
from adapt.spec import ModelSpec


def plan_from_dict(d: Any, spec: ModelSpec | None, source: str = "plan") -> ParallelPlan:
    """Parse and check a plan dict (from plan.yaml)."""
    if not isinstance(d, dict):
        raise PlanError(f"{source}: expected a mapping at the top level")
    allowed = {"adapt_plan", "model", "degrees", "world_size", "devices_per_node", "nodes", "num_experts",
               "layer_ranges", "ranks", "estimates", "cluster", "workload"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise PlanError(f"{source}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    deg = d.get("degrees")
    if not isinstance(deg, dict):
        raise PlanError(f"{source}: 'degrees' must be a mapping with tp, pp, ep, dp")
    bad = sorted(set(deg) - {"tp", "pp", "ep", "dp"})
    if bad:
        raise PlanError(f"{source}: unknown key 'degrees.{bad[0]}'")
    vals = {}
    for k in ("tp", "pp", "ep", "dp"):
        v = deg.get(k, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{source}: 'degrees.{k}' must be a positive integer, got {v!r}")
        vals[k] = v
    world = vals["tp"] * vals["pp"] * vals["dp"]
    if "world_size" in d and d["world_size"] != world:
        raise PlanError(f"{source}: 'world_size' is {d['world_size']} but tp*pp*dp = "
                        f"{vals['tp']}*{vals['pp']}*{vals['dp']} = {world}")
    dpn = d.get("devices_per_node", world)
    if not isinstance(dpn, int) or dpn < 1:
        raise PlanError(f"{source}: 'devices_per_node' must be a positive integer")
    ranges = d.get("layer_ranges")
    if ranges is not None and (not isinstance(ranges, list) or not all(
            isinstance(r, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            for r in ranges)):
        raise PlanError(f"{source}: 'layer_ranges' must be a list of [start, stop] integer pairs")
    for key in ("num_experts", "nodes"):
        if key in d and not isinstance(d[key], int):
            raise PlanError(f"{source}: '{key}' must be an integer, got {d[key]!r}")
    if spec is None:
        raise PlanError(f"{source}: a model spec is needed to check the plan")
    plan = ParallelPlan.build(spec, **vals, devices_per_node=dpn, layer_ranges=ranges, model=str(d.get("model", "")))
    if "num_experts" in d and d["num_experts"] != plan.num_experts:
        raise PlanError(f"{source}: 'num_experts' is {d['num_experts']} but the model has {plan.num_experts}")
    if "nodes" in d and d["nodes"] != plan.nodes:
        raise PlanError(f"{source}: 'nodes' is {d['nodes']} but world size {plan.world_size} over "
                        f"{plan.devices_per_node} devices per node needs {plan.nodes}")
    if "ranks" in d:
        _check_rank_map(d["ranks"], plan, source)
    return plan


def _check_rank_map(ranks: Any, plan: ParallelPlan, source: str) -> None:
    if not isinstance(ranks, list):
        raise PlanError(f"{source}: 'ranks' must be a list")
    seen: dict[int, int] = {}
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            raise PlanError(f"{source}: 'ranks[{i}].rank' must be an integer")
        if r["rank"] in seen:
            raise PlanError(f"{source}: 'ranks[{i}].rank' {r['rank']} overlaps ranks[{seen[r['rank']]}]")
        seen[r["rank"]] = i
    missing = sorted(set(range(plan.world_size)) - set(seen))
    if missing:
        raise PlanError(f"{source}: 'ranks' has a gap: rank {missing[0]} is missing (world size {plan.world_size})")
    extra = sorted(set(seen) - set(range(plan.world_size)))
    if extra:
        raise PlanError(f"{source}: 'ranks' holds rank {extra[0]} beyond world size {plan.world_size}")
    for i, r in enumerate(ranks):
        want = asdict(plan.ranks[r["rank"]])
        for key, value in r.items():
            if key not in want:
                raise PlanError(f"{source}: unknown key 'ranks[{i}].{key}'")
            w = want[key]
            got = tuple(value) if isinstance(value, list) else value
            if got != (tuple(w) if isinstance(w, (list, tuple)) else w):
                raise PlanError(f"{source}: 'ranks[{i}].{key}' is {value!r}; the degrees give {list(w) if isinstance(w, tuple) else w!r}")


def plan_to_yaml(plan: ParallelPlan, extra: dict[str, Any] | None = None) -> str:
    """plan.yaml text: degrees, layer ranges and the explicit rank map (plus ``extra`` top-level keys such as
    ``estimates``, ``cluster``, ``workload``). Ranks are written one flow mapping a line."""
    d = plan.to_dict()
    ranks = d.pop("ranks")
    d.update(extra or {})
    head = yaml.safe_dump(d, sort_keys=False, default_flow_style=None, width=120)
    lines = ["ranks:"]
    for r in ranks:
        lines.append("- " + yaml.safe_dump(r, default_flow_style=True, sort_keys=False, width=10**9).strip())
    return head + "\n".join(lines) + "\n"


def load_plan(path: str | Path, spec: ModelSpec) -> ParallelPlan:
    """Read and check a plan.yaml (hand-written or from ``adapt plan --out``); errors name the file and field."""
    return ParallelPlan.from_dict(read_yaml(path, PlanError, "plan"), spec, source=str(Path(path)))
