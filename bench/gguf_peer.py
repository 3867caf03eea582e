"""llama.cpp as a peer on the same weights: a transformers checkpoint written as GGUF, and greedy decode timed
through llama-cpp-python's low-level API.

``write_gguf`` writes a plain Llama (``llama``) or a Qwen3-MoE (``qwen3moe``) checkpoint with the ``gguf``
package's writer, its 2-D weights in one of F32 / F16 / BF16 / Q8_0 / Q4_0 (gguf.quants' numpy quantizers, the
same round-to-nearest llama.cpp's own converter applies: Q8_0 one f16 scale per 32 weights, Q4_0 one f16 scale
per 32 4-bit weights), norms and the MoE router kept F32 as llama.cpp's converter keeps them. llama.cpp's llama
graph applies RoPE to adjacent pairs where transformers rotates the two halves of each head, so a Llama's
q_proj / k_proj rows are permuted per head as llama.cpp's converter does (Qwen3-MoE runs llama.cpp's NEOX RoPE,
transformers' layout, and is copied as is). The vocabulary is SentencePiece-shaped (``<unk>``, ``<s>``,
``</s>``, byte tokens, then plain pieces): llama.cpp needs one to load; prompts and answers cross as token ids.

``LlamaCpp`` holds one model and one context of ``n_seq`` sequences and runs batch-b greedy decode with b
sequences (distinct seq_ids) in each ``llama_batch``, as adapt's engine decodes a batch.
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
ATTN = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
DENSE_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
ARCH = {"llama": "llama", "qwen3_moe": "qwen3moe"}


def bytes_per_weight(qtype: str) -> float:
    """Bytes a GGUF tensor of this type holds per weight, its block scales included (Q8_0: 34 B / 32)."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return nbytes / block


def _rope_pairs(w, heads: int):
    """Rows of each head reordered from transformers' half-split RoPE layout to llama.cpp's adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(w, cfg: dict) -> None:
    import gguf

    n = cfg["vocab_size"]
    nb = min(256, n - 3)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(nb)] + [f"t{i}" for i in range(3 + nb, n)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
        [gguf.TokenType.BYTE] * nb + [gguf.TokenType.NORMAL] * (n - 3 - nb)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id(cfg.get("eos_token_id") or 2)
    w.add_add_bos_token(False)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32") -> Path:
    """``hf_dir``'s weights as a GGUF llama.cpp loads: 2-D weights in ``qtype``, norms and router in F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = ARCH.get(cfg.get("model_type"))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch is None or rope.get("rope_type", "default") != "default" or qtype not in QTYPES:
        raise ValueError(f"write_gguf takes a plain Llama or Qwen3-MoE (no rope scaling) and one of {QTYPES}")
    sd: dict = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        sd.update(load_file(f))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if arch == "qwen3moe":
        if not cfg.get("norm_topk_prob", False) or cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("write_gguf: llama.cpp's qwen3moe has MoE in every layer with normalized top-k weights")
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _vocab(w, cfg)

    def put(name: str, t) -> None:
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        mlp = {} if f"{p}mlp.gate.weight" in sd else DENSE_MLP
        for hf, cpp in (ATTN | mlp).items():
            t = sd.get(f"{p}{hf}.weight")
            if t is None:
                continue  # q_norm / k_norm: Qwen3 only
            if arch == "llama" and cpp == "attn_q":
                t = _rope_pairs(t, heads)
            elif arch == "llama" and cpp == "attn_k":
                t = _rope_pairs(t, kv)
            put(f"blk.{i}.{cpp}.weight", t)
        if not mlp:
            put(f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}mlp.gate.weight"])
            for hf, cpp in EXPERTS.items():  # [E, N, K]
                put(f"blk.{i}.{cpp}.weight", np.stack([sd[f"{p}mlp.experts.{e}.{hf}.weight"]
                                                      for e in range(n_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


class LlamaCpp:
    """One GGUF model in llama.cpp (CPU, ``threads`` threads) with a context of ``n_seq`` sequences of up to
    ``seq_len`` tokens each. ``extra_bufts`` (llama.cpp's AMX and repacked-weight buffer types) is off by default:
    with it on, this host's llama-cpp-python 0.3.36 build (AMX_INT8 compiled in) dies of SIGILL / SIGSEGV in its
    first Q8_0 / Q4_0 decode, so the peer runs llama.cpp's plain CPU kernels (AVX-512 VNNI block dot products)."""

    def __init__(self, gguf_path: Path, threads: int, n_seq: int = 16, seq_len: int = 128, extra_bufts: bool = False):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_log_set(_QUIET, ctypes.c_void_p())
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = n_seq * seq_len, n_seq
        cp.n_batch = cp.n_ubatch = max(512, n_seq * 32)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cp.n_batch, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, seq_id, wants logits) rows."""
        b = self.batch
        for i, (t, pos, s, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, out
            b.seq_id[i][0] = s
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, i: int):
        import numpy as np

        return np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def prompt_logits(self, ids: list[int]):
        """[T, V] float32 logits of every position of one prompt (sequence 0)."""
        import numpy as np

        self._clear()
        self._decode([(t, p, 0, True) for p, t in enumerate(ids)])
        return np.stack([self._logits(i).copy() for i in range(len(ids))])

    def generate(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        """Greedy ``n`` tokens for each prompt, all prompts one batch (sequence s = prompt s): the tokens and
        decode tokens/s (the n-1 steps after the prefill, which gives the first token; as adapt counts)."""
        self._clear()
        self._decode([(t, p, s, p == len(ps) - 1) for s, ps in enumerate(prompts) for p, t in enumerate(ps)])
        ends = [sum(len(p) for p in prompts[:s + 1]) - 1 for s in range(len(prompts))]
        out = [[int(self._logits(e).argmax())] for e in ends]
        t0 = time.perf_counter()
        for step in range(n - 1):
            self._decode([(o[-1], len(ps) + step, s, True) for s, (ps, o) in enumerate(zip(prompts, out))])
            for s, o in enumerate(out):
                o.append(int(self._logits(s).argmax()))
        dt = time.perf_counter() - t0
        return out, len(prompts) * (n - 1) / dt if n > 1 else 0.0


def _quiet(level, text, user_data):  # llama.cpp's log lines would fill the bench's stderr
    pass


try:
    import llama_cpp as _lc

    _QUIET = _lc.llama_log_callback(_quiet)
except ImportError:
    _QUIET = None


PEERS = {"llama.cpp bf16": "BF16", "llama.cpp q8_0": "Q8_0", "llama.cpp q4_0": "Q4_0"}  # timed form -> GGUF type
VERSUS = {"bf16": "llama.cpp bf16"} | {f"{q}{a}{h}": f"llama.cpp {peer}" for q, peer in (("int8", "q8_0"), ("int4", "q4_0"))
                                        for a in ("", "-a8") for h in ("", "+lm_head")}  # adapt form -> its peer


def absent() -> str | None:
    """Why llama.cpp cannot be the peer here, or None when it can (this bench installs nothing)."""
    for mod, pip in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
        try:
            __import__(mod)
        except ImportError:
            return f"{pip} is not installed (import {mod} failed); this bench installs nothing"
    return None


def open_peers(src: Path, tmp: Path, ref, threads: int, seq_len: int, check_ids: list[int]):
    """GGUFs of ``src`` (BF16 / Q8_0 / Q4_0) opened in llama.cpp, and a report: the F32 GGUF against adapt's
    float32 engine ``ref`` on the same weights (greedy tokens and logits of ``check_ids``: the same model?),
    bytes per weight and seconds to write each file."""
    import numpy as np

    from adapt.runtime.sampling import SamplingParams

    rep: dict = {"threads": threads, "extra_bufts": False}
    f32 = LlamaCpp(write_gguf(src, tmp / "peer-F32.gguf", "F32"), threads, n_seq=1, seq_len=seq_len)
    ours = ref.prefill_logits(check_ids).float().numpy()
    theirs = f32.prompt_logits(check_ids)
    n = 16
    toks = ref.generate([check_ids[:16]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    toks = getattr(toks, "token_ids", toks)
    rep["f32_vs_adapt_fp32"] = {"logits_max_abs": float(np.abs(ours - theirs).max()),
                                "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
                                "greedy_equal": list(toks) == f32.generate([check_ids[:16]], n)[0][0],
                                "positions": len(check_ids), "greedy_tokens": n}
    f32.close()
    (tmp / "peer-F32.gguf").unlink()
    peers = {}
    for form, q in PEERS.items():
        t = time.perf_counter()
        path = write_gguf(src, tmp / f"peer-{q}.gguf", q)
        rep.setdefault("write_s", {})[form] = round(time.perf_counter() - t, 1)
        rep.setdefault("file_bytes", {})[form] = path.stat().st_size
        rep.setdefault("bytes_per_weight", {})[form] = bytes_per_weight(q)
        peers[form] = LlamaCpp(path, threads, n_seq=16, seq_len=seq_len)
    return peers, rep


def top1_agreement(ref, adapt_engines: dict, peers: dict, ids: list[int]) -> dict:
    """Share of ``ids``' positions whose argmax equals adapt float32's, per adapt form and llama.cpp form."""
    base = ref.prefill_logits(ids).float().argmax(-1).numpy()
    out = {f: float((e.prefill_logits(ids).float().argmax(-1).numpy() == base).mean()) for f, e in adapt_engines.items()}
    out |= {f: float((m.prompt_logits(ids).argmax(-1) == base).mean()) for f, m in peers.items()}
    return {f: round(v, 4) for f, v in out.items()}
