import re

from adapt.validate.checklist import default_checklist_path, load_checklist, thresholds_for

KINDS = {"manifest_verify", "memory_vs_profile", "staged_init", "end_to_end", "image_path",
         "parallel_consistency", "operator_alignment", "layer_alignment", "long_context", "kv_quant_impact",
         "service", "chat_template", "batch_invariance", "serving_load", "weight_quant_impact"}
SECTIONS = ["model_loading", "runtime_startup", "text_inference", "image_inference", "multi_device",
            "operator_alignment", "layer_alignment", "long_context", "kv_cache_quant", "weight_quant", "service",
            "serving"]
THRESHOLD_LINE = re.compile(r"^\s*([A-Za-z0-9_]+_(?:min|max))\s*:\s*([^#\s]+)\s*(#.*)?$")
ORIGIN = re.compile(r"#\s*\[(twin|fa2x|msprobe|vllm|runtime|adapt)\]")


def test_day0_loads_with_expected_shape():
    cl = load_checklist()
    assert [s.id for s in cl.sections] == SECTIONS
    assert {it.kind for it in cl.items()} == KINDS
    assert cl.item("image_path").required is True  # a text model skips it; a VLM must pass it
    assert {it.params["layout"] for it in cl.items() if it.kind == "parallel_consistency"} >= {"tp2", "ep2", "pp2"}
    assert cl.item("long_context_ladder").params["lengths"] == [1024, 8192, 32768]
    assert thresholds_for(cl.item("prefill_logits"), "float32") == {"cosine_min": 0.99999, "max_abs_max": 1e-4}
    assert thresholds_for(cl.item("kernels_vs_twin"), "float32") == {"max_abs_max": 1e-5}
    assert thresholds_for(cl.item("kernels_vs_twin"), "bfloat16")["max_abs_vs_torch_ratio_max"] == 2.0


def test_every_threshold_line_cites_its_origin():
    lines = default_checklist_path().read_text().splitlines()
    seen = set()
    for n, line in enumerate(lines, 1):
        m = THRESHOLD_LINE.match(line)
        if m:
            assert m.group(3) and ORIGIN.search(m.group(3)), f"day0.yaml:{n}: threshold without an origin comment"
            seen.add(m.group(1))
    loaded = {name for it in load_checklist().items() for block in it.thresholds.values() for name in block}
    # every loaded threshold was written on such a line (no flow-style mapping escapes the check)
    assert loaded == seen
