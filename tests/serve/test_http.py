"""The OpenAI-compatible server, driven by the official ``openai`` client against uvicorn on
127.0.0.1 (an ephemeral port, loopback only): both APIs streamed and not give Model.generate's
solo text, bad input answers 400 naming the field, a full queue 429, a disconnect frees the
request's pages, /v1/models, /health and /metrics, and a bounded load of concurrent streams
ends with every text equal to its solo run and allocated bytes back at their start value."""

from __future__ import annotations

import http.client
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.serve import Engine  # noqa: E402
from tinyloop.serve.http import ServerThread, create_app  # noqa: E402


@pytest.fixture(scope="module")
def served(chat_model_path):
    """(model, engine, server, client, allocated bytes before the engine started)."""
    m = tinyloop.load_model(chat_model_path, max_seq_len=512, backend="numpy")
    m.generate("warm", max_new_tokens=1)           # the lazy logit row exists before
    before = m.pool.allocated_bytes
    eng = Engine(m, max_batch=16, max_queue=96, prefill_chunk=16).start()
    try:
        with ServerThread(create_app(eng, "tiny")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)
            yield m, eng, srv, client, before
    finally:
        eng.stop()
        tinyloop.free_model(m)


def _solo(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, **kw).text


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def test_completions_streamed_and_not_equal_the_solo_text(served):
    m, eng, srv, client, _ = served
    prompt = "The quick brown fox"
    want = _solo(m, prompt, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(m.generate(prompt, max_new_tokens=12).token_ids)
    assert r.usage.prompt_tokens == len(m.encode_prompt(prompt))
    s = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  stream=True)
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    # seeded sampling, token ids as the prompt, the extra fields
    ids = m.encode_prompt("abc").tolist()
    want = _solo(m, ids, 10, temperature=0.8, top_k=30, seed=5, depth=3, kv_mode="int8")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0.8,
                                  seed=5, extra_body={"top_k": 30, "depth": 3,
                                                      "kv_mode": "int8"})
    assert r.choices[0].text == want


def test_ignore_eos_extra_field_runs_past_the_eos(served):
    """"ignore_eos": true (vLLM's extra field) on a seeded request whose run samples the EOS
    id: all max_tokens tokens, the text of Model.generate(ignore_eos=True); without it the
    run stops at that EOS."""
    m, eng, srv, client, _ = served
    ids = m.encode_prompt("abc").tolist()
    kw = dict(temperature=1.0, seed=7)
    full = m.generate(ids, max_new_tokens=10, **kw)
    first = next(i for i in range(1, 10) if full.token_ids[i] not in full.token_ids[:i])
    eos = m.config.eos_token_id
    object.__setattr__(m.config, "eos_token_id", full.token_ids[first])
    try:
        want = m.generate(ids, max_new_tokens=10, ignore_eos=True, **kw)
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, **kw,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text and r.usage.completion_tokens == 10
        assert r.choices[0].finish_reason == "length"
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, **kw)
        assert r.usage.completion_tokens == first and r.choices[0].finish_reason == "stop"
    finally:
        object.__setattr__(m.config, "eos_token_id", eos)


def test_chat_streamed_and_not_equal_the_solo_text_of_the_template(served):
    m, eng, srv, client, _ = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = m.tokenizer.apply_chat_template(msgs, tokenize=True)
    assert m.tokenizer.decode(ids).endswith("user: hi there\nassistant:")
    want = _solo(m, ids, 9)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9,
                                       temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    s = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9,
                                       temperature=0, stream=True)
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "x", "depth": 99}, "depth"),
    ({"prompt": "x", "kv_mode": "bogus"}, "kv_mode"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 1000}, "max_tokens"),      # past max_seq_len
    ({}, "prompt"),
    # past float range: float() of them raised OverflowError, a bare 500
    ({"prompt": "x", "max_tokens": 10 ** 400}, "max_tokens"),
    ({"prompt": "x", "repetition_penalty": 10 ** 400}, "repetition_penalty"),
    ({"prompt": "x", "stop": ["y" * 1025]}, "stop"),             # MAX_STOP_CHARS
    ({"prompt": "x", "max_completion_tokens": -3, "max_tokens": 2}, "max_completion_tokens"),
])
def test_bad_completion_input_answers_400_naming_the_field(served, body, param):
    m, eng, srv, client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/completions", body={"model": "tiny", **body}, cast_to=object)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_chat_input_and_bad_json_answer_400(served):
    m, eng, srv, client, _ = served
    for messages, param in [([], "messages"), ([{"content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 3}], "messages[0].content")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages)
        assert e.value.body["param"] == param
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/v1/completions", body=b"{not json",
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "not valid JSON" in json.loads(resp.read())["error"]["message"]
    conn.close()


def _raw_post(srv, body: bytes, path: str = "/v1/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("POST", path, body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_bodies_that_gave_a_bare_500_answer_400(served):
    m, eng, srv, client, _ = served
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        status, out = _raw_post(srv, body)
        assert status == 400 and "nests too deeply" in out["error"]["message"]
    for name in ("content", "role"):            # a lone surrogate: no UTF-8 for the template
        msg = {"role": "user", "content": "hi"} | {name: "a\ud800"}
        body = json.dumps({"model": "tiny", "messages": [msg]}).encode()   # ASCII escapes
        status, out = _raw_post(srv, body, "/v1/chat/completions")
        assert status == 400 and out["error"]["param"] == f"messages[0].{name}", out
    # a top_k past int64 keeps every token: the request runs, as top_k = 0
    got = client.completions.create(model="tiny", prompt="ab", max_tokens=4, seed=1,
                                    temperature=0.9, extra_body={"top_k": 10 ** 400})
    assert got.choices[0].text == _solo(m, "ab", 4, temperature=0.9, seed=1)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing_naming_the_prompt(
        served, monkeypatch):
    """A prompt past MAX_CHARS_PER_POSITION characters a position (3 MB), or one under it
    that Tokenizer.min_tokens' bound puts past max_seq_len (120 KB), is refused without
    being encoded (a 15 MB encoding took seconds and gigabytes), naming 'prompt'
    ('messages' on the chat route, checked on the rendered text); a prompt that fits alone
    but not with max_tokens names max_tokens."""
    from tinyloop.generate import MAX_CHARS_PER_POSITION
    m, eng, srv, client, _ = served
    encoded = []
    real = type(m.tokenizer).encode
    monkeypatch.setattr(type(m.tokenizer), "encode",
                        lambda self, t, *a, **k: encoded.append(len(t)) or real(self, t, *a, **k))
    mid = "ab " * 40_000
    assert len(mid) < m.max_seq_len * MAX_CHARS_PER_POSITION < m.tokenizer.min_tokens(mid) * \
        MAX_CHARS_PER_POSITION
    for text, words in (("ab " * 1_000_000, "character limit"), (mid, "at least")):
        for chat in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                if chat:
                    client.chat.completions.create(model="tiny", max_tokens=1,
                                                   messages=[{"role": "user", "content": text}])
                else:
                    client.completions.create(model="tiny", prompt=text, max_tokens=0)
            assert e.value.body["param"] == ("messages" if chat else "prompt")
            assert words in e.value.body["message"]
    assert not [n for n in encoded if n >= len(mid)]            # never encoded
    with pytest.raises(openai.BadRequestError) as e:            # 300 ids fit, + 300 do not
        client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=300)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:            # 600 ids alone do not
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=0)
    assert e.value.body["param"] == "prompt"


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(served):
    m, eng, srv, client, _ = served
    r = client.post("/completions", body={"model": "tiny", "prompt": "ab", "max_tokens": 2,
                                          "max_completion_tokens": None, "ignore_eos": True},
                    cast_to=object)
    assert r["usage"]["completion_tokens"] == 2


def test_requests_are_tokenized_off_the_event_loop(served, monkeypatch):
    """The engine's submit (tokenizing, the chat template) runs on a worker thread: on the
    event loop a long prompt held up every other client until it was tokenized."""
    import asyncio
    m, eng, srv, client, _ = served
    on_loop = []
    real = eng.submit

    def submit(*a, **kw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(*a, **kw)
    monkeypatch.setattr(eng, "submit", submit)
    client.completions.create(model="tiny", prompt="ab", max_tokens=1)
    client.chat.completions.create(model="tiny", max_tokens=1,
                                   messages=[{"role": "user", "content": "ab"}])
    assert on_loop == [False, False]


def test_an_oversized_body_answers_413_and_is_not_read(served, monkeypatch):
    """A body past the limit: 413 with OpenAI's error object, whether its length is declared
    or it comes chunked; a body under the limit still works after."""
    from tinyloop.serve import http as tl_http
    m, eng, srv, client, _ = served
    monkeypatch.setattr(tl_http, "MAX_BODY_BYTES", 4096)
    big = json.dumps({"model": "tiny", "prompt": "x" * 8000, "max_tokens": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/v1/completions", body=big,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == 413 and f"{len(big)} bytes" in err["message"]
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for i in range(0, len(big), 1000):
        part = big[i:i + 1000]
        conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
    conn.send(b"0\r\n\r\n")
    resp = conn.getresponse()
    assert resp.status == 413 and "over 4096 bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2,
                                     temperature=0).choices[0].finish_reason == "length"


def test_models_health_and_metrics(served):
    m, eng, srv, client, _ = served
    assert [x.id for x in client.models.list().data] == ["tiny"]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3, temperature=0)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ok = [s for s in fams["tinyloop_requests"].samples
          if s.labels == {"route": "/v1/completions", "status": "200"}
          and s.name.endswith("_total")]
    assert ok and ok[0].value >= 1
    assert [s.value for s in fams["tinyloop_queue_length"].samples] == [0]
    ttft = [s for s in fams["tinyloop_time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]
    assert ttft[0].value >= 1
    tags = {s.labels["tag"]: s.value for s in fams["tinyloop_pool_allocated_bytes"].samples}
    assert tags["weights"] == m.pool.by_tag()["weights"] > 0
    gen = [s.value for s in fams["tinyloop_generated_tokens"].samples
           if s.name.endswith("_total")]
    assert gen[0] >= 3


def test_a_full_queue_answers_429(served):
    m = served[0]
    # a second engine on the model: one batch slot, one queue place; while the test holds
    # the model's lock the engine cannot step, so the third request finds the queue full
    eng = Engine(m, max_batch=1, max_queue=1).start()
    try:
        with ServerThread(create_app(eng, "tiny")) as srv, \
                ThreadPoolExecutor(max_workers=2) as pool:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)

            def post():
                return client.completions.create(model="tiny", prompt="q", max_tokens=2,
                                                 temperature=0)
            with m.lock:
                futures = [pool.submit(post) for _ in range(2)]
                _wait(lambda: eng.stats()["active"] + eng.stats()["queued"] == 2, 30)
                with pytest.raises(openai.RateLimitError) as e:
                    client.completions.create(model="tiny", prompt="q", max_tokens=2)
                assert e.value.status_code == 429 and "queue is full" in e.value.message
            assert [f.result(timeout=60).choices[0].text for f in futures] == \
                [_solo(m, "q", 2)] * 2
    finally:
        eng.stop()


def test_a_client_that_disconnects_mid_stream_frees_its_pages(served):
    m, eng, srv, client, before = served
    base = m.pool.by_tag()["kv_cache"]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    body = json.dumps({"model": "tiny", "prompt": "a long one", "max_tokens": 480,
                       "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()                                # the first event arrived: it is decoding
    assert eng.stats()["active"] == 1
    conn.sock.close()                              # the client leaves mid-stream
    conn.close()
    _wait(lambda: eng.stats()["active"] == 0)
    assert m.pool.by_tag()["kv_cache"] == base
    assert eng.stats()["finished"].get("cancelled", 0) >= 1


def test_a_client_that_disconnects_from_a_non_streamed_request_frees_its_pages(served,
                                                                            monkeypatch):
    """A non-streamed answer writes nothing until its end, so the handler itself must see
    the client go while tokens keep coming (each decode step slowed so the request is still
    decoding long after the close)."""
    m, eng, srv, client, before = served
    base = m.pool.by_tag()["kv_cache"]
    cancelled = eng.stats()["finished"].get("cancelled", 0)
    real = m.decode_batch_start

    def slow(*a, **k):
        time.sleep(0.02)
        return real(*a, **k)
    monkeypatch.setattr(m, "decode_batch_start", slow)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    body = json.dumps({"model": "tiny", "prompt": "a long one", "max_tokens": 480,
                       "temperature": 0})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    _wait(lambda: eng.stats()["active"] == 1 and eng.stats()["generated_tokens"] > 0)
    gen0 = eng.stats()["generated_tokens"]
    _wait(lambda: eng.stats()["generated_tokens"] > gen0 + 2)    # tokens keep coming
    conn.sock.close()                              # the client leaves
    conn.close()
    t0 = time.monotonic()
    _wait(lambda: eng.stats()["active"] == 0)
    assert time.monotonic() - t0 < 5              # far less than the 480 slowed steps
    assert eng.stats()["finished"].get("cancelled", 0) == cancelled + 1
    assert m.pool.by_tag()["kv_cache"] == base


def test_a_bounded_load_of_concurrent_streams(served):
    """64 concurrent streams of a few tokens: no error, every greedy text equal to its solo
    run, allocated bytes back to their value before the server started."""
    m, eng, srv, client, before = served
    rng = np.random.default_rng(0)
    prompts = ["".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 30))))
               for _ in range(64)]
    want = [_solo(m, p, 4) for p in prompts]

    def stream(p):
        s = client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0,
                                      stream=True)
        return "".join(c.choices[0].text for c in s)

    with ThreadPoolExecutor(max_workers=64) as ex:
        got = list(ex.map(stream, prompts, timeout=120))
    assert got == want
    _wait(lambda: eng.stats()["active"] == 0)
    assert m.pool.allocated_bytes == before


def test_a_stopped_engine_answers_503(served):
    m = served[0]
    eng = Engine(m).start()
    eng.stop()
    with ServerThread(create_app(eng, "tiny")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and "stopped" in e.value.message
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        conn.close()


def _slow_body(port: int, path: str = "/v1/completions") -> tuple[int, dict]:
    """Declare a 100-byte body, send one byte, wait: (status, JSON body) of the answer."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 100\r\n\r\n{".encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", data.lower()).group(1)):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def test_a_body_that_never_arrives_whole_answers_408_and_long_messages_are_cut(served):
    """A client sending a byte now and then held its connection forever; past body_timeout_s
    the server answers 408 and the connection is free. An error message quoting a huge
    value is cut at MAX_MESSAGE_CHARS."""
    from tinyloop.serve.http import MAX_MESSAGE_CHARS
    m, eng, srv, client, _ = served
    with ServerThread(create_app(eng, "tiny", body_timeout_s=0.3)) as quick:
        t0 = time.monotonic()
        status, out = _slow_body(quick.port)
        assert status == 408 and "did not arrive whole within 0.3 s (1 bytes came)" in \
            out["error"]["message"]
        assert time.monotonic() - t0 < 20
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", extra_body={"kv_mode": "z" * 10 ** 5})
    assert e.value.body["param"] == "kv_mode"
    assert len(e.value.body["message"]) == MAX_MESSAGE_CHARS + 3


@pytest.mark.parametrize("chat", [False, True])
def test_stream_options_include_usage_ends_the_stream_with_the_usage(served, chat):
    """OpenAI's stream_options.include_usage: every chunk has "usage": null and one last
    chunk without choices carries the request's token counts (it was ignored)."""
    m, eng, srv, client, _ = served
    kw = dict(model="tiny", max_tokens=5, temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if chat:
        msgs = [{"role": "user", "content": "ab"}]
        chunks = list(client.chat.completions.create(messages=msgs, **kw))
        n_prompt = len(m.tokenizer.apply_chat_template(msgs, tokenize=True))
    else:
        chunks = list(client.completions.create(prompt="ab", **kw))
        n_prompt = len(m.encode_prompt("ab"))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    u = chunks[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 5, n_prompt + 5)
    with pytest.raises(openai.BadRequestError) as e:       # only with stream: true
        client.completions.create(model="tiny", prompt="ab", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def _requests_with_status(srv, status: str) -> float:
    text = http_get_text(srv.url + "/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams["tinyloop_requests"].samples
               if s.labels.get("status") == status and s.name.endswith("_total"))


def http_get_text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_a_client_that_leaves_mid_body_is_counted_499(served):
    """A client closing its connection before its body was whole raised starlette's
    ClientDisconnect out of the handler (a logged traceback, the request uncounted); it is
    counted 499 and the server serves on."""
    import socket
    m, eng, srv, client, _ = served
    before = _requests_with_status(srv, "499")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    _wait(lambda: _requests_with_status(srv, "499") == before + 1, 30)
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=2).choices
