"""What to write: every rank's output tensors (sliced by adapt.plan only) packed into files."""

from __future__ import annotations

from typing import Any, Callable

from adapt.errors import ShardError
from adapt.layout import WeightLayout, is_quantizable, quantized_tensors
from adapt.plan import ParallelPlan, TensorSlice, rank_tensors, scale_slice, stored_slice_of
from adapt.shard.checkpoint import Checkpoint
from adapt.shard.manifest import OutputFile, OutputTensor, rank_dir
from adapt.shard.transform import Quantize, plan_transform, target_dtype
from adapt.units import parse_bytes

DEFAULT_MAX_FILE_SIZE = 5 * 10**9


def parse_size(text: str | int, option: str = "--max-file-size") -> int:
    """'5GB', '500MiB', '20KB' or a byte count -> bytes; else a ShardError naming ``option``."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    n = parse_bytes(text)
    if n is None:
        raise ShardError(f"{option} must be a size such as 5GB, 500MiB or 20KB; got {text!r}")
    return n


def rank_outputs(ckpt: Checkpoint, layout: WeightLayout, plan: ParallelPlan, rank: int, names: set[str],
                 dtype_choice: str, quantize: Quantize | None = None) -> list[OutputTensor]:
    """The tensors rank writes, in layout order: slices from adapt.plan, scale blocks by scale_slice; with
    ``quantize``, each linear weight's slice as the parts of its quantized form (``quantized_slice``). An lm_head
    the checkpoint does not hold (``layout`` unties a tied head for ``--quantize-lm-head``) is read from the
    embedding."""
    scales = {t.scale_of: t for t in layout if t.scale_of is not None}
    comps: dict[str, list] = {}
    for c in layout:
        if c.scale_of is not None:
            comps.setdefault(c.scale_of, []).append(c)
    q = layout.spec.quant
    block = q.block_size if q else None
    lm_head = quantize is not None and quantize.lm_head
    embed = next((t.name for t in layout if t.role == "embed"), None)
    out = []
    for t, s in rank_tensors(layout, plan, rank):
        source = embed if lm_head and t.role == "lm_head" and t.name not in names else t.name
        if source not in names:
            continue
        src = ckpt.tensors[source]
        if q is not None and q.method != "fp8" and t.name in comps:  # compressed-tensors, kept as stored
            out += kept_parts(ckpt, t, s, comps[t.name], names, layout.spec)
            continue
        scale = scales.get(t.name)
        if quantize is not None and is_quantizable(t, lm_head) and quantize.spec.quantizes(t.name):
            sl = TensorSlice(source, s.dim, s.start, s.stop)
            out += quantized_slice(t, sl, src, scale, quantize, target_dtype(dtype_choice) or layout.spec.dtype,
                                   source)
            continue
        quantized = scale is not None and src.dtype == "float8_e4m3fn"
        transform, dtype = plan_transform(src.dtype, dtype_choice, quantized)
        out.append(OutputTensor(t.name, t.name, src.file, s, s.shape(src.shape), src.shape, transform, dtype,
                                src.dtype, scale.name if transform == "fp8_block_dequant" else None))
        if scale is not None and transform != "fp8_block_dequant" and scale.name in names:
            ss = scale_slice(s, scale, block)
            ssrc = ckpt.tensors[scale.name]
            out.append(OutputTensor(scale.name, scale.name, ssrc.file, ss, ss.shape(ssrc.shape), ssrc.shape, "none",
                                    ssrc.dtype, ssrc.dtype))
    return out


def kept_parts(ckpt: Checkpoint, t, s: TensorSlice, comps: list, names: set[str], spec) -> list[OutputTensor]:
    """A compressed-tensors weight's stored tensors for rank slice ``s`` of its logical [N, K], as stored
    (``stored_slice_of``: packed words, group-scale columns, zero-point rows); a sliced weight's ``weight_shape``
    is rewritten to the rank's [n, k] (transform ``shape:NxK``)."""
    out = []
    for p in [t] + [c for c in comps if c.name in names]:
        src = ckpt.tensors[p.name]
        ps = stored_slice_of(p, t, s, spec)
        transform = "none"
        if p.name.endswith("weight_shape") and not s.whole:
            transform = "shape:" + "x".join(str(d) for d in s.shape(t.shape))
        out.append(OutputTensor(p.name, p.name, src.file, ps, ps.shape(src.shape), src.shape, transform, src.dtype,
                                src.dtype))
    return out


def quantized_slice(t, s: TensorSlice, src, scale, quantize: Quantize, scale_dtype: str,
                    source: str | None = None) -> list[OutputTensor]:
    """The parts (weight, scales, shape, as WeightLayout names them) of rank slice ``s`` of linear weight t,
    quantized on its own: blocks and groups start at the slice's first row and column. ``source``: the
    checkpoint tensor read (default t's own name)."""
    n, k = s.shape(src.shape)
    g = quantize.group_size
    if quantize.scheme == "int4" and k % g:
        raise ShardError(f"{t.name}: --group-size {g} does not divide K = {k}"
                         + (f" (this rank's columns {s.start}..{s.stop})" if s.dim == 1 else "")
                         + "; int4 groups must tile each row")
    fp8_src = scale is not None and src.dtype == "float8_e4m3fn"
    parts = quantized_tensors(quantize.spec, t.name, (n, k), t.role, t.split, t.layer, t.expert, t.tp_dim,
                              t.head_size, t.mtp, scale_dtype)
    return [OutputTensor(p.name, source or t.name, src.file, s, p.stored_shape, src.shape, quantize.transform, p.stored_dtype,
                         src.dtype, scale.name if fp8_src else None) for p in parts]


def pack_files(rank: int, tensors: list[OutputTensor], max_file_size: int,
               order: Callable[[OutputTensor], Any]) -> list[OutputFile]:
    """Split a rank's tensors into files of at most max_file_size bytes (a larger tensor gets its own). A file
    draws on one source file only, and holds its tensors in source-offset order (``order``): one forward
    pass over a source file then feeds every rank's files from it (:mod:`adapt.shard.fanout`)."""
    groups: list[list[OutputTensor]] = []
    size = 0
    for t in sorted(tensors, key=order):
        n = OutputFile("", rank, (t,)).nbytes
        if not groups or groups[-1][-1].source_file != t.source_file or (size + n > max_file_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    total = len(groups)
    return [OutputFile(f"{rank_dir(rank)}/model-{i + 1:05d}-of-{total:05d}.safetensors", rank, tuple(g))
            for i, g in enumerate(groups)]


def plan_outputs(ckpt: Checkpoint, layout: WeightLayout, plan: ParallelPlan, names: list[str], dtype_choice: str,
                 max_file_size: int, quantize: Quantize | None = None) -> list[OutputFile]:
    """Every output file of every rank, without sizes and checksums."""
    present = set(names)
    files: list[OutputFile] = []
    pos = {f: i for i, f in enumerate(ckpt.files)}

    def order(t: OutputTensor):
        return pos[t.source_file], ckpt.tensors[t.source].offset, t.source, t.name

    for rank in range(plan.world_size):
        files += pack_files(rank, rank_outputs(ckpt, layout, plan, rank, present, dtype_choice, quantize),
                            max_file_size,
                            order)
    return files


def scale_blocks(weight: TensorSlice, block: tuple[int, int], scale_shape: tuple[int, ...]) -> TensorSlice:
    """The scale rows (or columns) covering a weight slice, for dequantization (need not be block aligned)."""
    if weight.whole:
        return TensorSlice(weight.name)
    b = block[weight.dim]
    return TensorSlice(weight.name, weight.dim, weight.start // b, min(scale_shape[weight.dim], -(-weight.stop // b)))
