"""``adapt plan``'s library: search tensor / pipeline / expert / data parallel layouts for a cluster.

Library functions return data; ``adapt/cli/plan.py`` renders it.
"""

from adapt.profile.planner.cluster import Cluster, Workload, cluster_from_dict, load_cluster, make_cluster
from adapt.profile.planner.comm import CollectiveBytes, decode_collective_bytes, stage_collectives
from adapt.profile.planner.emit import launch_flags
from adapt.profile.planner.estimate import Memory, Times, memory, times
from adapt.profile.planner.search import Candidate, PlanResult, Rejection, check_plan, evaluate, search
from adapt.profile.planner.weights import per_layer, stage_weights

__all__ = ["Cluster", "Workload", "cluster_from_dict", "load_cluster", "make_cluster", "CollectiveBytes",
           "decode_collective_bytes", "stage_collectives", "launch_flags", "Memory", "Times", "memory", "times",
           "Candidate", "PlanResult", "Rejection", "check_plan", "evaluate", "search", "per_layer",
           "stage_weights"]
