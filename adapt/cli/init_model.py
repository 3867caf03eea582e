"""`adapt init-model NAME DIR`: write a deterministic tiny checkpoint of a built-in model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from adapt.cli.output import err_console


def init_model(
    name: Annotated[str, typer.Argument(help="Built-in model: tiny-k2, tiny-llama, tiny-qwen3-moe.")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (HF layout).")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
) -> None:
    """config.json, model.safetensors, generation_config.json, tokenizer.json with a chat template."""
    from adapt.runtime.init_model import init_model as write

    out = write(name, out_dir, seed=seed)
    err_console.print(f"wrote {name} to {out}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("init-model")(init_model)
