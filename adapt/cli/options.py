"""Shared option aliases (huggingface_hub's CLI style), so every command spells an option the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ModelArg = Annotated[str, typer.Argument(help="HF checkpoint directory, config.json, built-in name "
                                              "(tiny-k2, tiny-llama, tiny-qwen3-moe) or hub id.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help="Built-in accelerator name "
                                          "(see `adapt hardware list`) or a YAML file.")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="Output format.")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the output to this file.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="Any torch device string: cpu, cuda, npu, xpu, ...")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16")]
KERNELS_HELP = ("auto (each op from the best backend for the device and dtype) | cpu | triton | torch | reference "
                "| a plugin backend's name (its ops; the rest from torch). `adapt ops MODEL` shows the mapping.")
PrepackOpt = Annotated[str, typer.Option("--prepack", help="CPU: pack linear weights once for oneDNN. auto: every "
                       "dtype (float32 sums in another order, a few ulp); exact: only bfloat16 / float16 (bitwise "
                       "F.linear); off.")]
WeightsDtypeOpt = Annotated[Optional[str], typer.Option("--weights-dtype", help="Weight dtype "
                            "(default: the checkpoint's native dtype): float32, bfloat16, float16, fp8, int8, int4.")]
KvDtypeOpt = Annotated[str, typer.Option("--kv-dtype", help="KV cache dtype: bfloat16, float16, fp8, int8, float32.")]
ContextOpt = Annotated[int, typer.Option("--context", "-L", min=1, help="Context length in tokens.")]
