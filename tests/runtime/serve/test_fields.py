"""No output-changing field ignored (issue 32): vLLM's guided_* / structured_outputs, min_tokens, min_p,
prompt_logprobs, echo and include_stop_str_in_output served - each checked against a reference written here (re,
the model's own logits, the field's definition) - and every other known field that would change the output
refused with a 400 naming it."""
import json
import logging
import math
import re

import pytest

from test_sampling_api import ref  # noqa: F401  (the model's own logits, in-process: a fixture)
from test_server import client, raw  # noqa: E402  (same folder)

PROMPT = [5, 9, 2, 7]
MSGS = [{"role": "user", "content": "a code, please"}]


def _post(server, path, **body):
    st, data = raw(server, "POST", path, {"model": server.model_name, **body})
    return st, json.loads(data)


def _complete(server, **body):
    st, data = _post(server, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
    assert st == 200, data
    return data


# -- structured output: guided_* and structured_outputs ----------------------------------------------------------
@pytest.mark.parametrize("field", [{"guided_regex": "[0-9]{6}"}, {"structured_outputs": {"regex": "[0-9]{6}"}}])
def test_guided_regex_holds_the_output(server, field):
    """Sampled at temperature 1 (the model left alone writes anything): every output is 6 digits, chat and
    completions, streamed as not."""
    c = client(server)
    for seed in range(3):
        r = c.chat.completions.create(model=server.model_name, messages=MSGS, max_tokens=20, temperature=1.0,
                                      seed=seed, extra_body=field)
        assert re.fullmatch(r"[0-9]{6}", r.choices[0].message.content), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
        streamed = "".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
            model=server.model_name, messages=MSGS, max_tokens=20, temperature=1.0, seed=seed, extra_body=field,
            stream=True) if x.choices)
        assert streamed == r.choices[0].message.content
        t = c.completions.create(model=server.model_name, prompt="x", max_tokens=20, temperature=1.0, seed=seed,
                                 extra_body=field).choices[0].text
        assert re.fullmatch(r"[0-9]{6}", t), t


CHOICES = ["yes", "no", "a.b*c", 'say "hi"\n', "ünïcode ✓"]


@pytest.mark.parametrize("field", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}},
                                   {"guided_grammar": "start: " + " | ".join(json.dumps(x) for x in CHOICES)}])
def test_guided_choice_and_grammar_give_one_of_the_choices(server, field):
    c = client(server)
    got = set()
    for seed in range(6):
        r = c.chat.completions.create(model=server.model_name, messages=MSGS, max_tokens=20, temperature=1.5,
                                      seed=seed, extra_body=field)
        assert r.choices[0].message.content in CHOICES and r.choices[0].finish_reason == "stop"
        got.add(r.choices[0].message.content)
    assert len(got) >= 2            # sampled, not one fixed answer


def test_guided_json_validates(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for field in ({"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        st, r = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=40, temperature=0.7, seed=3, **field)
        assert st == 200, r
        if r["choices"][0]["finish_reason"] == "stop":
            v = json.loads(r["choices"][0]["message"]["content"])
            assert set(v) == {"n", "ok"} and isinstance(v["n"], int) and isinstance(v["ok"], bool)
        else:
            assert r["choices"][0]["message"]["content"].startswith('{"')


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "[0-9]", "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "guided_regex"),
])
def test_conflicting_or_malformed_constraints_are_400s(server, body, param):
    st, r = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=4, **body)
    assert st == 400, r
    assert r["error"]["param"] == param, r


def test_a_bad_regex_is_a_400(server):
    st, r = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=4, guided_regex="[0-9")
    assert st == 400, r


# -- min_tokens, min_p -----------------------------------------------------------------------------------------------
def test_min_tokens_holds_back_stop_tokens_and_stop_strings(server):
    """logit_bias makes token 11 certain; as a stop token it ends the output at once - unless min_tokens, which keeps
    it out of the first min_tokens tokens (vLLM). Stop strings count only after min_tokens tokens."""
    r = _complete(server, logit_bias={"11": 100}, stop_token_ids=[11], max_tokens=8)
    assert r["usage"]["completion_tokens"] == 1
    r = _complete(server, logit_bias={"11": 100}, stop_token_ids=[11], max_tokens=8, min_tokens=4, logprobs=0)
    ch = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 5 and ch["finish_reason"] == "stop"
    assert server.tok.decode([11]) not in ch["logprobs"]["tokens"][:4]
    a = server.tok.encode("a")[0]                               # "aaaa...": the stop string "a" is everywhere
    assert _complete(server, logit_bias={str(a): 100}, stop="a")["choices"][0]["text"] == ""
    ch = _complete(server, logit_bias={str(a): 100}, stop="a", min_tokens=3)["choices"][0]
    assert (ch["text"], ch["finish_reason"]) == ("aaa", "stop")
    st, e = _post(server, "/v1/completions", prompt="x", max_tokens=3, min_tokens=4)
    assert st == 400 and e["error"]["param"] == "min_tokens"


def test_min_p_drops_unlikely_tokens(server):
    """At temperature 1 (no penalties) the sampled distribution is the model's, whose log-probabilities the response
    carries: with min_p every sampled token's probability is >= min_p x the likeliest's; without, some is not."""
    def worst(**kw):
        lo = 0.0
        for seed in range(4):
            r = _complete(server, temperature=1.0, seed=seed, max_tokens=12, logprobs=1, **kw)["choices"][0]["logprobs"]
            for lp, top in zip(r["token_logprobs"], r["top_logprobs"]):
                lo = min(lo, lp - max(top.values()))          # log(p / p_max)
        return lo
    # (the tiny model's distribution is flat: every token is within e^-1.1 of the likeliest)
    assert worst(min_p=0.6) >= math.log(0.6) - 1e-4
    assert worst() < math.log(0.6)            # the control: without min_p such tokens are drawn


def test_allowed_token_ids(server, ref):
    r = _complete(server, allowed_token_ids=[40, 41, 300], logprobs=0)["choices"][0]
    assert set(r["logprobs"]["tokens"]) <= {server.tok.decode([t]) for t in (40, 41, 300)}
    st, e = _post(server, "/v1/completions", prompt="x", allowed_token_ids=[99999])
    assert st == 400 and e["error"]["param"] == "allowed_token_ids"


# -- include_stop_str_in_output ------------------------------------------------------------------------------------
def test_include_stop_str_in_output(server):
    plain = _complete(server, max_tokens=12)["choices"][0]["text"]
    stop = plain[3:5]
    cut = plain[:plain.find(stop)]
    assert _complete(server, max_tokens=12, stop=stop)["choices"][0]["text"] == cut
    r = _complete(server, max_tokens=12, stop=stop, include_stop_str_in_output=True)["choices"][0]
    assert (r["text"], r["finish_reason"]) == (cut + stop, "stop")
    st, e = _post(server, "/v1/completions", prompt="x", include_stop_str_in_output="yes")
    assert st == 400 and e["error"]["param"] == "include_stop_str_in_output"


# -- prompt_logprobs and echo --------------------------------------------------------------------------------------
def _check_prompt_logprobs(server, ref, prompt, plp, k):
    """vLLM's shape: None, then per token {id: {logprob, rank, decoded_token}} of the prompt's token and the k most
    likely, the values the model's own."""
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        lp = ref(prompt[:i]).log_softmax(-1)
        d = plp[i]
        mine = d[str(prompt[i])]
        assert mine["logprob"] == pytest.approx(float(lp[prompt[i]]), abs=1e-4)
        assert mine["rank"] == 1 + int((lp > lp[prompt[i]]).sum())
        assert mine["decoded_token"] == server.tok.decode([prompt[i]])
        vals, idx = lp.topk(k)
        for j, (v, t) in enumerate(zip(vals.tolist(), idx.tolist())):
            assert d[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            if t != prompt[i]:
                assert d[str(t)]["rank"] == j + 1
        assert set(d) == {str(prompt[i]), *map(str, idx.tolist())}


def test_prompt_logprobs_completions_and_chat(server, ref):
    r = _complete(server, prompt_logprobs=2, n=2)
    for ch in r["choices"]:
        _check_prompt_logprobs(server, ref, PROMPT, ch["prompt_logprobs"], 2)
    st, r = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=3, prompt_logprobs=1)
    assert st == 200, r
    ids = server.tok.encode(server.chat_text({"messages": MSGS}))
    assert r["usage"]["prompt_tokens"] == len(ids)
    _check_prompt_logprobs(server, ref, ids, r["prompt_logprobs"], 1)
    assert "prompt_logprobs" not in _complete(server)["choices"][0]
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 2, "stream": True}):
        st, e = _post(server, "/v1/completions", prompt="x", max_tokens=2, **bad)
        assert st == 400 and e["error"]["param"] == "prompt_logprobs", e


def test_echo_with_the_official_client(server, ref):
    """echo: the prompt's text before the completion's; with logprobs its tokens come first, the first without a
    logprob (OpenAI's and vLLM's shape), streamed as not."""
    c = client(server)
    text = "The tiers"
    plain = c.completions.create(model=server.model_name, prompt=text, max_tokens=5, temperature=0).choices[0].text
    r = c.completions.create(model=server.model_name, prompt=text, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == text + plain
    r = c.completions.create(model=server.model_name, prompt=text, max_tokens=5, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ids = server.tok.encode(text)
    assert lp.tokens[:len(ids)] == [server.tok.decode([t]) for t in ids] and "".join(lp.tokens) == text + plain
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        want = ref(ids[:i]).log_softmax(-1)
        assert lp.token_logprobs[i] == pytest.approx(float(want[ids[i]]), abs=1e-4)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(want.topk(2).values.tolist(),
                                                                                abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(c.completions.create(model=server.model_name, prompt=text, max_tokens=5, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(text)
    assert "".join(x.choices[0].text for x in chunks if x.choices) == text + plain
    streamed = [t for x in chunks if x.choices and x.choices[0].logprobs for t in x.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    # a prompt of token ids: their text
    r = c.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(server.tok.decode(PROMPT))


# -- the fields refused and the fields ignored -----------------------------------------------------------------------
REFUSED = [("best_of", 3), ("use_beam_search", True), ("length_penalty", 0.5), ("bad_words", ["x"]),
           ("truncate_prompt_tokens", 3), ("logits_processors", ["x"]), ("skip_special_tokens", False),
           ("spaces_between_special_tokens", False), ("return_tokens_as_token_ids", True),
           ("return_token_ids", True), ("prompt_embeds", "abc"), ("kv_transfer_params", {}), ("priority", 1),
           ("vllm_xargs", {"a": 1}), ("mm_processor_kwargs", {"a": 1}), ("guided_whitespace_pattern", " ")]


@pytest.mark.parametrize("name, value", REFUSED + [("suffix", "end"), ("add_special_tokens", False)])
def test_completions_refuse_what_they_do_not_serve(server, name, value):
    st, e = _post(server, "/v1/completions", prompt="x", max_tokens=2, **{name: value})
    assert st == 400, e
    assert e["error"]["param"] == name and name in e["error"]["message"]


@pytest.mark.parametrize("name, value", REFUSED + [
    ("echo", True), ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"}),
    ("modalities", ["text", "audio"]), ("reasoning_effort", "high"), ("verbosity", "low"),
    ("web_search_options", {}), ("documents", [{"text": "x"}]), ("chat_template", "{{ messages }}")])
def test_chat_refuses_what_it_does_not_serve(server, name, value):
    st, e = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=2, **{name: value})
    assert st == 400, e
    assert e["error"]["param"] == name and name in e["error"]["message"]


def test_harmless_values_and_ignored_fields_pass(server, caplog):
    """A refused field at the value that changes nothing passes; the fields ignored on purpose pass and are logged
    once; a field no server of this API knows passes (clients send other servers' extra_body), as vLLM's does."""
    harmless = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
                "skip_special_tokens": True, "priority": 0, "suffix": "", "echo": False, "modalities": ["text"]}
    ignored = {"user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
               "prompt_cache_key": "k", "guided_decoding_backend": "xgrammar", "request_id": "r1"}
    base = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=4, temperature=0)[1]
    with caplog.at_level(logging.INFO, logger="tiered_moe.serve"):
        for _ in range(2):
            st, r = _post(server, "/v1/chat/completions", messages=MSGS, max_tokens=4, temperature=0,
                          my_other_servers_field=1, **harmless, **ignored)
            assert st == 200, r
            assert r["choices"][0]["message"] == base["choices"][0]["message"]
    logged = [m for m in caplog.messages if "accepted and ignored" in m]
    for name in ignored:
        assert sum(f"'{name}'" in m for m in logged) <= 1
    from runtime.serve.params import _logged
    assert set(ignored) <= _logged
