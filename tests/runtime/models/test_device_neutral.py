"""The model modules describe the architecture only: CPU weight layouts (oneDNN prepacking, column panels,
packed MoE experts, router panels) live in the cpu backend (adapt/runtime/backends/cpu_layouts.py).

The pattern is issue 33's acceptance grep plus the CPU ISA names; the model files say "tokens of the step
(sequences concatenated)" rather than "packed tokens", so any hit of "pack" there is weight-layout code."""

import re
from pathlib import Path

import adapt.runtime.models as models

CPU_LAYOUT = re.compile(r"onednn|mkldnn|mkl|panel|amx|avx|vnni|pack", re.IGNORECASE)


def layout_hits(root: Path) -> list[str]:
    """``file:line: text`` for every line of a .py file under ``root`` naming a CPU weight layout."""
    return [f"{p.relative_to(root)}:{i}: {line.strip()}"
            for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if CPU_LAYOUT.search(line)]


def test_models_hold_no_cpu_layout_code():
    hits = layout_hits(Path(models.__file__).parent)
    assert not hits, "CPU layout code in adapt/runtime/models/ (move it to backends/cpu_layouts.py):\n" + "\n".join(hits)


def test_the_grep_finds_layout_code(tmp_path):
    # the check can fail: a model file with a packed weight is caught, a plain one is not
    (tmp_path / "plain.py").write_text("def linear(x, w):\n    return x @ w.T\n")
    (tmp_path / "bad.py").write_text("import torch\n\nw = torch.ops.mkldnn._reorder_linear_weight(w, 16)\n"
                                     "def prepack(m):\n    pass\n")
    assert layout_hits(tmp_path) == ["bad.py:3: w = torch.ops.mkldnn._reorder_linear_weight(w, 16)",
                                     "bad.py:4: def prepack(m):"]
