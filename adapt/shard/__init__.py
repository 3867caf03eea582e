"""adapt shard: stream a checkpoint into per-rank safetensors files by the plan, with a manifest and verify.

Public API:
  shard(checkpoint, out_dir, plan=None, *, tp, pp, ep, dp, plan_file, dtype, max_file_size, workers, ...)
  verify(out_dir, source=None) -> VerifyReport
  load_manifest(out_dir) -> Manifest;  open_rank(out_dir, rank) -> {name: (TensorSlice, loader)}
"""

from adapt.shard.manifest import Manifest, OutputFile, OutputTensor, load_manifest, open_rank
from adapt.shard.run import ShardResult, shard
from adapt.shard.verify import Problem, VerifyReport, verify

__all__ = ["shard", "verify", "load_manifest", "open_rank", "Manifest", "OutputFile", "OutputTensor",
           "ShardResult", "VerifyReport", "Problem"]
