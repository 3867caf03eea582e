"""Real clients against the service: the official openai client (sync, async, streaming) and lm-eval's
local-completions / local-chat-completions on a tiny task written by the test (loglikelihood and
generate_until). Prompt log-likelihoods equal the engine's own prefill logits (float32, 1e-5)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.runtime.server.conftest import PROMPTS

KEY = "sk-clients"


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    """A second engine over the same checkpoint, never served: the offline oracle."""
    from tests.runtime.server.conftest import load_engine

    return load_engine(tiny_llama)


@pytest.fixture(scope="module")
def srv(tiny_llama):
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, start_server

    eng = Engine.from_pretrained(tiny_llama, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=16,
                                 enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    s = start_server(eng, config=ServiceConfig("tiny", api_key=KEY))
    yield s
    s.stop()


def _greedy(engine, prompts: list[str], n: int) -> list[list[int]]:
    from adapt.runtime.sampling import SamplingParams

    ids = [engine.tokenizer.encode(p) for p in prompts]
    return [r.token_ids for r in engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


def _prompt_logprobs(engine, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 from the engine's whole-prompt prefill logits."""
    lsm = torch.log_softmax(engine.prefill_logits(ids).double(), dim=-1)
    return [float(lsm[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_openai_sync_completions_chat_and_stream(srv, ref_engine):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    want = _greedy(ref_engine, PROMPTS[:3], 8)
    r = c.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [ch.model_extra["token_ids"] for ch in sorted(r.choices, key=lambda x: x.index)] == want
    texts = [ref_engine.tokenizer.decode(w) for w in want]
    assert [ch.text for ch in sorted(r.choices, key=lambda x: x.index)] == texts
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == texts[0]
    msgs = [{"role": "user", "content": "Say hi"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == full.choices[0].message.content
    assert parts[-1].usage.completion_tokens == full.usage.completion_tokens
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="x", temperature=-1)


def test_openai_async_concurrent_equal_sequential(srv, ref_engine):
    openai = pytest.importorskip("openai")
    want = _greedy(ref_engine, PROMPTS, 10)

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

        async def one(p: str, stream: bool):
            kw = dict(model="tiny", prompt=p, max_tokens=10, temperature=0,
                      extra_body={"ignore_eos": True, "return_token_ids": True})
            if not stream:
                return (await c.completions.create(**kw)).choices[0].model_extra["token_ids"]
            ids = []
            async for ch in await c.completions.create(stream=True, **kw):
                ids += ch.choices[0].model_extra["token_ids"]
            return ids

        return await asyncio.gather(*[one(p, i % 2 == 1) for i, p in enumerate(PROMPTS * 3)])

    got = asyncio.run(main())
    assert got == want * 3


def test_echo_and_prompt_logprobs_equal_the_engine(srv, ref_engine):
    from tests.runtime.server.conftest import Client

    ids = ref_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog") * 3  # > one 16-token chunk
    ref = _prompt_logprobs(ref_engine, ids)
    c = Client(srv.url)
    h = {"Authorization": f"Bearer {KEY}"}
    for mt in (0, 1):
        status, body = c.request("POST", "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1,
                                                             "max_tokens": mt, "temperature": 0}, headers=h)
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + mt
        got = lp["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    status, body = c.request("POST", "/v1/completions", {"prompt": ids, "prompt_logprobs": 2, "max_tokens": 1,
                                                         "temperature": 0}, headers=h)
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert max(abs(plp[j][str(ids[j])]["logprob"] - ref[j - 1]) for j in range(1, len(ids))) < 1e-5


def _write_task(d) -> None:
    rows = [{"q": f"Question {i}: what is {i} plus {i}?", "choices": [f" {2 * i}", f" {i}", " zebra"], "label": 0}
            for i in range(4)]
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'data.jsonl'}\ntest_split: test\n"
    (d / "tiny_mc.yaml").write_text("task: tiny_mc\n" + common + 'output_type: multiple_choice\n'
                                    'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
                                    "metric_list:\n  - metric: acc\n")
    (d / "tiny_gen.yaml").write_text("task: tiny_gen\n" + common + 'output_type: generate_until\n'
                                     'doc_to_text: "{{q}}"\ndoc_to_target: "{{choices[0]}}"\n'
                                     'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 6\n'
                                     "metric_list:\n  - metric: exact_match\n")


def test_lm_eval_local_completions_loglikelihood_equals_the_engine(srv, ref_engine, tiny_llama, tmp_path,
                                                                   monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    _write_task(tmp_path)
    tm = TaskManager(include_path=str(tmp_path))
    args = f"model=tiny,base_url={srv.url}/v1/completions,tokenizer={tiny_llama},num_concurrent=4,max_retries=1"
    res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_mc", "tiny_gen"],
                                  task_manager=tm, log_samples=True)
    lm = get_model("local-completions")(model="tiny", base_url=srv.url + "/v1/completions",
                                        tokenizer=str(tiny_llama))
    n = 0
    for s in res["samples"]["tiny_mc"]:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            c_ids, k_ids = lm._encode_pair(ctx, cont)  # the token split lm-eval sent
            ref = sum(_prompt_logprobs(ref_engine, c_ids + k_ids)[len(c_ids) - 1:])
            assert abs(resp[0][0] - ref) < 1e-5, (ctx, cont, resp, ref)
            n += 1
    assert n == 12
    gen = res["samples"]["tiny_gen"]
    assert len(gen) == 4 and all(isinstance(s["resps"][0][0], str) for s in gen)
    from adapt.runtime.sampling import SamplingParams

    ids = lm.tok_encode(gen[0]["arguments"][0][0])  # as lm-eval sent it (its tokenizer adds BOS)
    want = ref_engine.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert gen[0]["resps"][0][0] == want.split("\n\n")[0]


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generate_until(srv, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    _write_task(tmp_path)
    res = lm_eval.simple_evaluate(model="local-chat-completions",
                                  model_args=f"model=tiny,base_url={srv.url}/v1/chat/completions,num_concurrent=2,"
                                             "max_retries=1", tasks=["tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                                  apply_chat_template=True)
    gen = res["samples"]["tiny_gen"]
    assert len(gen) == 4 and all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in gen)
