"""Replicas on the CUDA backend: two worker processes, each pinned by CUDA_VISIBLE_DEVICES
(devices 0 and 1 where there are two GPUs, both on device 0 otherwise), behind the router:
concurrent greedy requests reach both replicas and give the NumPy reference's text for most
of its length (the batched products may part from the reference within rounding; the common
prefixes are compared and reported), and each worker's allocated bytes return to their
baseline after the load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx2 = pytest.importorskip("httpx2")
pytest.importorskip("starlette")

import tinyloop  # noqa: E402
from tinyloop.convert.synthetic import (byte_level_tokenizer_json, synthetic_config,  # noqa: E402
                                        synthetic_weights)
from tinyloop.format import write_tlm  # noqa: E402
from tinyloop.serve.http import ServerThread  # noqa: E402
from tinyloop.serve.replica import ReplicaSpec  # noqa: E402
from tinyloop.serve.router import REPLICA_HEADER, ReplicaSet, create_router_app  # noqa: E402

from ..model.conftest import SMALL  # noqa: E402
from .replica_helpers import _allocated, _wait  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    """SMALL dims with a byte-level tokenizer, so the router's text can be compared."""
    cfg = synthetic_config(**SMALL, bos_token_id=256, eos_token_id=257)
    p = tmp_path_factory.mktemp("gpu") / "small_tok.tlm"
    write_tlm(p, cfg, synthetic_weights(cfg, 3),
              tokenizer_json=byte_level_tokenizer_json(cfg.vocab_size))
    return str(p)


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cuda_replicas_pinned_per_device_agree_with_the_reference(small_path):
    import cupy
    devices = ["0", "1"] if cupy.cuda.runtime.getDeviceCount() >= 2 else ["0", "0"]
    rng = np.random.default_rng(2)
    prompts = ["".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(20, 60))))
               for _ in range(8)]
    ref = tinyloop.load_model(small_path, max_seq_len=128, backend="numpy")
    try:
        want = [ref.generate(p, max_new_tokens=16).text for p in prompts]
    finally:
        tinyloop.free_model(ref)
    spec = ReplicaSpec(model=small_path, backend="cuda", max_seq_len=128, max_batch=8)
    with ReplicaSet(spec, 2, devices, start_timeout_s=600) as rs:
        for w, dev in zip(rs.workers, devices):
            with open(f"/proc/{w.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"CUDA_VISIBLE_DEVICES"] == dev.encode()
        with ServerThread(create_router_app(rs, "small")) as srv:
            for w in rs.workers:              # warm, then the baseline
                httpx2.post(w.url + "/v1/completions", json={"prompt": prompts[0],
                                                             "max_tokens": 2},
                            timeout=300).raise_for_status()
            base = {w.index: _allocated(w.url) for w in rs.workers}

            def one(p):
                r = httpx2.post(srv.url + "/v1/completions", timeout=300,
                                json={"prompt": p, "max_tokens": 16, "temperature": 0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"], int(r.headers[REPLICA_HEADER])

            with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
                got = list(ex.map(one, prompts))
            assert {rep for _, rep in got} == {0, 1}
            for w in rs.workers:
                _wait(lambda w=w: _allocated(w.url) == base[w.index], 60,
                      f"{w.name}'s allocated bytes back at baseline")
    prefix = [_common(text, ref_text) for (text, _), ref_text in zip(got, want)]
    print("greedy common text prefix per request:", prefix, "of", [len(t) for t in want])
    assert sum(text[:1] == ref_text[:1] for (text, _), ref_text in zip(got, want)) >= 7
    assert np.mean(prefix) >= 0.5 * np.mean([len(t) for t in want])
