"""The Ray Serve deployment (``tinyloop.serve.ray_app``) on a local Ray (loopback only, no
dashboard) with two CPU replicas on the NumPy backend: the official ``openai`` client against
Ray's proxy gets the solo text over both APIs, streamed and not, and Serve's shutdown frees
the replicas. Skipped where ray is not importable (the ray extra)."""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import tinyloop  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.serve import ReplicaSpec, ray_app  # noqa: E402

from .test_replicas import MAX_SEQ_LEN, solo  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tinyloop.__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_served(chat_model_path):
    """An openai client against Ray Serve's proxy on 127.0.0.1 over two replicas."""
    old = os.environ.get("PYTHONPATH")
    # the actors import this checkout's tinyloop, as the driver does
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + ([old] if old else []))
    ray.init(address="local", include_dashboard=False, num_cpus=2,
             _node_ip_address="127.0.0.1")
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(model=chat_model_path, backend="numpy", max_seq_len=MAX_SEQ_LEN,
                           max_batch=4, max_queue=16, model_name="tiny")
        serve.run(ray_app(spec, replicas=2), name="tinyloop", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        yield client
    finally:
        serve.shutdown()
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def test_ray_replicas_give_the_solo_text_over_both_apis(ray_served, solo):
    client = ray_served
    for prompt in ("The quick brown fox", "another prompt"):
        want = solo.generate(prompt, max_new_tokens=8).text
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                      temperature=0)
        assert r.choices[0].text == want
        s = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                      temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in s) == want
    msgs = [{"role": "user", "content": "hi there"}]
    want = solo.generate(solo.tokenizer.apply_chat_template(msgs, tokenize=True),
                         max_new_tokens=6).text
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                       temperature=0)
    assert r.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    status = serve.status().applications["tinyloop"]
    assert status.deployments["tinyloop"].replica_states.get("RUNNING") == 2


def test_ray_app_refuses_a_bad_replica_count(chat_model_path):
    with pytest.raises(ConfigError, match="replicas"):
        ray_app(chat_model_path, replicas=0, backend="numpy")
