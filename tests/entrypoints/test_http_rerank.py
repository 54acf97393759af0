"""POST /v1/rerank (/rerank, /v2/rerank) and /v1/score on real servers, with httpx:
- the yes/no reranker on the default model (the shared exact-mode server) and on a tiny random Qwen3: the
  scores equal transformers' float32 softmax([logit(no), logit(yes)])[1] of the Qwen3-Reranker template within
  1e-5, in the same order; /v1/score gives the same numbers for the same pairs;
- a tiny random Qwen3ForSequenceClassification served with --is-embedding: sigmoid of its head equals
  transformers' AutoModelForSequenceClassification on the tokenizer's pair encoding;
- the radix cache serves the query prefix to every document after the first (usage cached_tokens);
- token_ids_logprob, the scheduler field the yes/no scores read, on /generate against top_logprobs;
- bad input (10,000 documents past --max-rerank-documents, a 5 MB query, top_n 0 / absurd, empty lists),
  each followed by a request that succeeds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch

from radixserve.entrypoints.rerank.template import document_text, query_text
from tests.entrypoints.conftest import API_KEY
from tests.server_process import ServerProcess

TOL = 1e-5
LP_TOL = 1e-4  # logprobs of magnitude ~10, in float32
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "The cat sat on the mat.",
        "France's capital city is Paris, on the Seine.", "Berlin is the capital of Germany.",
        "Bananas are rich in potassium.", "Lyon is a large city in France."]


def rerank(http: httpx.Client, path: str = "/v1/rerank", **body) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    scores = [x["relevance_score"] for x in out["results"]]
    assert scores == sorted(scores, reverse=True)
    return out


def by_index(out: dict) -> list[float]:
    return [x["relevance_score"] for x in sorted(out["results"], key=lambda x: x["index"])]


def yes_no_reference(model, tokenizer, query: str, docs: list[str], instruction: str | None = None) -> list[float]:
    """transformers' float32 score of Qwen3-Reranker's recipe, the whole prompt tokenised as one text."""
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    out = []
    for d in docs:
        ids = tokenizer.encode(query_text(query, instruction) + document_text(d), add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        out.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    return out


def close(a: list[float], b: list[float]) -> bool:
    """Two of the server's own computations of the same pairs: a cached query prefix runs the attention of an
    EXTEND step instead of a whole prefill, which rounds differently (below 1e-6 here)."""
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < TOL


def assert_scores(got: list[float], ref: list[float]) -> None:
    assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, (got, ref)
    assert sorted(range(len(got)), key=lambda i: -got[i]) == sorted(range(len(ref)), key=lambda i: -ref[i])


# ----------------------------------------------------------------------------- the default model
def test_rerank_equals_transformers_on_the_default_model(http, hf_oracle, tokenizer):
    out = rerank(http, model="default", query=QUERY, documents=DOCS)
    assert sorted(x["index"] for x in out["results"]) == list(range(len(DOCS)))
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in out["results"])
    ref = yes_no_reference(hf_oracle, tokenizer, QUERY, DOCS)
    assert_scores(by_index(out), ref)
    assert len(set(ref)) == len(ref)  # the order compared is a real one
    # usage agrees with /tokenize of the same prompts
    prompts = [query_text(QUERY, None) + document_text(d) for d in DOCS]
    counts = http.post("/tokenize", json={"prompt": prompts, "add_special_tokens": False}).json()["count"]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == sum(counts)
    # the aliases, documents as objects, top_n and return_documents
    for path in ("/rerank", "/v2/rerank"):
        alias = rerank(http, path, query=QUERY, documents=[{"text": d} for d in DOCS], top_n=2,
                       return_documents=False)
        assert [x["index"] for x in alias["results"]] == [x["index"] for x in out["results"][:2]]
        assert all("document" not in x for x in alias["results"])
        assert close([x["relevance_score"] for x in alias["results"]], [x["relevance_score"] for x in out["results"][:2]])
    # an instruction is the template's <Instruct>
    instruction = "Given a question, find the passage that names a fruit"
    told = rerank(http, query=QUERY, documents=DOCS, instruction=instruction)
    assert_scores(by_index(told), yes_no_reference(hf_oracle, tokenizer, QUERY, DOCS, instruction))
    assert by_index(told) != by_index(out)


def test_score_equals_rerank(http):
    ranked = by_index(rerank(http, query=QUERY, documents=DOCS))
    r = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in body["data"])
    assert close([d["score"] for d in body["data"]], ranked)
    pairwise = http.post("/v1/score", json={"text_1": [QUERY, "Which fruit has potassium?"],
                                            "text_2": [DOCS[0], DOCS[4]]}).json()
    alone = http.post("/v1/score", json={"text_1": "Which fruit has potassium?", "text_2": DOCS[4]}).json()
    assert close([d["score"] for d in pairwise["data"]], [ranked[0], alone["data"][0]["score"]])
    assert pairwise["usage"]["prompt_tokens"] > 0


def test_the_radix_cache_shares_the_query_across_documents(http, tokenizer):
    # a query no earlier test sent, longer than the scheduler's in-batch prefix window (32 tokens): the first
    # document computes it, the others wait one step and find it in the tree
    query = f"{uuid.uuid4().hex} " + " ".join(["which passage is about rivers and mountains"] * 5)
    q_len = len(tokenizer.encode(query_text(query, None), add_special_tokens=False))
    assert q_len > 40
    before = http.get("/get_server_info").json()["cached_tokens"]
    out = rerank(http, query=query, documents=DOCS)
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(DOCS) - 1) * q_len, (cached, q_len)
    assert http.get("/get_server_info").json()["cached_tokens"] - before == cached


def test_token_ids_logprob_on_generate(http):
    prompt = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 5,
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    tops = r["meta_info"]["output_top_logprobs"]
    ids = [t for t, _ in tops[0]]
    # max_new_tokens 0: the one distribution after the prompt, nothing sampled. LP_TOL: the repeat finds the prompt
    # in the radix cache, and an EXTEND step's float32 logits round differently from a whole prefill's
    zero = http.post("/generate", json={"input_ids": prompt, "token_ids_logprob": ids,
                                        "sampling_params": {"max_new_tokens": 0}}).json()
    assert zero["output_ids"] == [] and len(zero["meta_info"]["output_token_ids_logprobs"]) == 1
    assert max(abs(a - b) for a, (_, b) in zip(zero["meta_info"]["output_token_ids_logprobs"][0], tops[0])) < LP_TOL
    # generating: one row per output token, the distribution it was drawn from
    gen = http.post("/generate", json={"input_ids": prompt, "token_ids_logprob": ids[:2],
                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    rows = gen["meta_info"]["output_token_ids_logprobs"]
    assert gen["output_ids"] == r["output_ids"] and len(rows) == 3
    for row, top in zip(rows, tops):
        top_d = dict(top)
        for tid, lp in zip(ids[:2], row):
            if tid in top_d:
                assert abs(lp - top_d[tid]) < LP_TOL
    for bad in ([], [-1], [10**9], "yes", [0] * 257):
        e = http.post("/generate", json={"input_ids": prompt, "token_ids_logprob": bad,
                                         "sampling_params": {"max_new_tokens": 0}})
        assert e.status_code == 400 and e.json()["error"]["param"] == "token_ids_logprob", e.text
    assert http.post("/generate", json={"input_ids": prompt, "token_ids_logprob": ids,
                                        "sampling_params": {"max_new_tokens": 0}}).status_code == 200


def _bad(http: httpx.Client, path: str, body: dict, status: int = 400, param: str | None = None) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    rerank(http, query=QUERY, documents=DOCS[:2])  # and the next request succeeds
    return err


def test_bad_input_is_refused_and_the_server_goes_on(http):
    err = _bad(http, "/v1/rerank", {"query": QUERY, "documents": ["x"] * 10_000}, param="documents")
    assert "1000" in err["message"] and "--max-rerank-documents" in err["message"]
    r = http.post("/v1/rerank", json={"query": "a" * 5_000_000, "documents": DOCS})
    assert r.status_code in (400, 413), r.text
    assert r.status_code == 413 or r.json()["error"]["param"] == "query"
    rerank(http, query=QUERY, documents=DOCS[:2])
    _bad(http, "/v1/rerank", {"query": QUERY, "documents": ["word " * 300]}, param="documents[0]")
    for top_n in (0, -1, 10**12):
        _bad(http, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": top_n}, param="top_n")
    _bad(http, "/v1/rerank", {"query": QUERY, "documents": []}, param="documents")
    _bad(http, "/v1/rerank", {"query": QUERY, "documents": [1, 2]})
    _bad(http, "/v1/rerank", {"documents": DOCS})
    _bad(http, "/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "nope"}, status=404)
    _bad(http, "/v1/score", {"text_1": [], "text_2": DOCS}, param="text_1")
    _bad(http, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, param="text_2")
    _bad(http, "/v1/score", {"text_1": QUERY, "text_2": ["x"] * 1001}, param="text_2")
    # top_n beyond the documents (within the cap) returns them all, as Jina and Cohere do
    assert len(rerank(http, query=QUERY, documents=DOCS[:3], top_n=50)["results"]) == 3


# ----------------------------------------------------------------------------- tiny random models
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, tokenizer) -> dict[str, str]:
    """A tiny random Qwen3 LM and a one-label Qwen3ForSequenceClassification, each saved with SmolLM2's
    tokenizer (which has single "yes" and "no" tokens)."""
    import transformers

    folders = {}
    for kind, cls, extra in (("lm", transformers.Qwen3ForCausalLM, {}),
                             ("cls", transformers.Qwen3ForSequenceClassification, {"num_labels": 1})):
        torch.manual_seed(7)
        cfg = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
                                       pad_token_id=None, **extra)
        path = tmp_path_factory.mktemp(f"tiny-rerank-{kind}")
        cls(cfg).save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        folders[kind] = str(path)
    return folders


def _serve(folder: str, *extra: str) -> Iterator[httpx.Client]:
    args = ["--model-path", folder, "--context-length", "512", "--max-total-tokens", "8192", "--api-key", API_KEY,
            "--quantization", "none", "--dtype", "float32", "--check-invariants", *extra]
    for srv in ServerProcess(args, api_key=API_KEY, context_len=512).running():
        with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as c:
            yield c


def test_tiny_yes_no_reranker_equals_transformers(tiny_folders, tokenizer):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folders["lm"], dtype=torch.float32).eval()
    for http in _serve(tiny_folders["lm"]):
        out = rerank(http, query=QUERY, documents=DOCS)
        ref = yes_no_reference(model, tokenizer, QUERY, DOCS)
        assert_scores(by_index(out), ref)
        assert max(ref) - min(ref) > 1e-3  # random weights that still tell the documents apart
        score = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        assert close([d["score"] for d in score["data"]], by_index(out))


def test_tiny_sequence_classifier_equals_transformers(tiny_folders, tokenizer):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tiny_folders["cls"], dtype=torch.float32).eval()
    ref = []
    for d in DOCS:
        ids = tokenizer(QUERY, d)["input_ids"]
        with torch.no_grad():
            ref.append(torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item())
    for http in _serve(tiny_folders["cls"], "--is-embedding"):
        out = rerank(http, query=QUERY, documents=DOCS)
        assert_scores(by_index(out), ref)
        assert max(ref) - min(ref) > 1e-3
        score = http.post("/v1/score", json={"text_1": [QUERY] * 2, "text_2": DOCS[:2]}).json()
        assert close([d["score"] for d in score["data"]], by_index(out)[:2])
        # a classifier has no template: an instruction is refused, and it serves no embeddings
        r = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "instruction"
        r = http.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "classifier" in r.text
        assert close(by_index(rerank(http, query=QUERY, documents=DOCS)), by_index(out))


@pytest.mark.parametrize("bad", [0, -1, 10**9])
def test_absurd_max_rerank_documents_is_refused_naming_the_knob(bad) -> None:
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="max_rerank_documents"):
        ServerArgs(max_rerank_documents=bad)
