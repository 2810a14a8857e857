"""``tinyloop serve``: its options reach the server, the model is freed when it ends, and bad
options fail before anything loads."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

import tinyloop  # noqa: E402
from tinyloop import cli  # noqa: E402
import tinyloop.serve.http  # noqa: E402


def test_serve_passes_its_options_and_frees_the_model(monkeypatch, tiny_model_path):
    seen = {}

    def fake_serve(model, host, port, **kw):
        seen.update(host=host, port=port, backend=model.backend, max_seq_len=model.max_seq_len,
                    pool=model.pool, before=model.pool.allocated_bytes, model=model, **kw)

    monkeypatch.setattr(tinyloop.serve.http, "serve", fake_serve)
    rc = cli.main(["serve", tiny_model_path, "--host", "0.0.0.0", "--port", "9123",
                   "--backend", "numpy", "--max-seq-len", "64", "--max-batch", "3",
                   "--queue", "5", "--kv-budget", "1M", "--model-name", "t",
                   "--prefix-cache", "2M", "--serial-rows", "4"])
    assert rc == 0
    assert seen["serial_rows"] == 4
    assert (seen["host"], seen["port"], seen["backend"], seen["max_seq_len"]) == \
        ("0.0.0.0", 9123, "numpy", 64)
    assert (seen["max_batch"], seen["max_queue"], seen["kv_budget"], seen["model_name"],
            seen["prefix_cache"]) == (3, 5, "1M", "t", "2M")
    assert seen["before"] > 0 and seen["model"].vram_usage_bytes() == 0   # freed at the end


@pytest.mark.parametrize("argv, word", [(["--max-batch", "0"], "--max-batch"),
                                        (["--queue", "-1"], "--queue"),
                                        (["--serial-rows", "-1"], "--serial-rows"),
                                        (["--max-seq-len", "0"], "max_seq_len")])
def test_serve_refuses_bad_options_by_name(tiny_model_path, capsys, argv, word):
    assert cli.main(["serve", tiny_model_path, *argv]) == 1
    assert word in capsys.readouterr().err


def test_serve_shares_a_prefix_cache_and_releases_it(monkeypatch, tiny_model_path):
    """serve() itself, with uvicorn.run replaced: the Engine gets a PrefixPool of the budget,
    released with the engine at the end."""
    import uvicorn
    seen = {}

    def fake_run(app, host, port, log_level):
        seen["app"] = app
        eng = app.state.engine
        seen["pool"] = eng.prefix_pool
        seen["max_bytes"] = eng.prefix_pool.max_bytes
        seen["running"] = eng.running

    monkeypatch.setattr(uvicorn, "run", fake_run)
    m = tinyloop.load_model(tiny_model_path, max_seq_len=32, backend="numpy")
    try:
        tinyloop.serve.http.serve(m, "127.0.0.1", 0, prefix_cache="1M")
        assert seen["max_bytes"] == 1 << 20 and seen["running"]
        with pytest.raises(tinyloop.errors.HandleError):
            seen["pool"].check(m)                # released at the end
    finally:
        tinyloop.free_model(m)


def test_serve_replicas_passes_a_spec_and_loads_nothing_itself(monkeypatch, tiny_model_path):
    import tinyloop.serve.router
    seen = {}

    def fake(spec, n, host, port, devices):
        seen.update(spec=spec, n=n, host=host, port=port, devices=devices)

    monkeypatch.setattr(tinyloop.serve.router, "serve_replicas", fake)
    monkeypatch.setattr(tinyloop.model, "load_model",
                        lambda *a, **k: pytest.fail("the router process loaded the model"))
    rc = cli.main(["serve", tiny_model_path, "--replicas", "3", "--devices", "1,0",
                   "--backend", "numpy", "--max-seq-len", "64", "--max-batch", "3",
                   "--queue", "5", "--kv-budget", "1M", "--prefix-cache", "2M",
                   "--model-name", "t", "--port", "9124", "--serial-rows", "0"])
    assert rc == 0
    s = seen["spec"]
    assert s.serial_rows == 0
    assert (seen["n"], seen["port"], seen["devices"]) == (3, 9124, ["1", "0"])
    assert (s.model, s.backend, s.max_seq_len, s.max_batch, s.max_queue, s.kv_budget,
            s.prefix_cache, s.name) == (tiny_model_path, "numpy", 64, 3, 5, "1M", "2M", "t")
    assert s.prefill_chunk == cli.DEFAULT_PREFILL_CHUNK["numpy"]


@pytest.mark.parametrize("argv, word", [(["--replicas", "0"], "--replicas"),
                                        (["--replicas", "2", "--devices", "0,x"], "--devices"),
                                        (["--devices", "0,1"], "--replicas")])
def test_serve_refuses_bad_replica_options_by_name(tiny_model_path, capsys, argv, word):
    assert cli.main(["serve", tiny_model_path, "--backend", "numpy", *argv]) == 1
    assert word in capsys.readouterr().err


def test_serve_ray_without_ray_names_the_extra(monkeypatch, tiny_model_path, capsys):
    import builtins
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert cli.main(["serve", tiny_model_path, "--backend", "numpy", "--ray"]) == 1
    assert "tinyloop[ray]" in capsys.readouterr().err


def test_serve_ray_passes_a_spec_to_ray_serve(monkeypatch, tiny_model_path, capsys):
    pytest.importorskip("ray")
    import tinyloop.serve.ray_serve
    seen = {}
    monkeypatch.setattr(tinyloop.serve.ray_serve, "serve_ray",
                        lambda spec, n, host, port, address: seen.update(
                            spec=spec, n=n, host=host, port=port, address=address))
    rc = cli.main(["serve", tiny_model_path, "--ray", "--replicas", "2", "--backend",
                   "numpy", "--max-seq-len", "64", "--ray-address", "auto", "--port", "9125"])
    assert rc == 0
    assert (seen["n"], seen["port"], seen["address"]) == (2, 9125, "auto")
    assert (seen["spec"].model, seen["spec"].backend, seen["spec"].max_seq_len) == \
        (tiny_model_path, "numpy", 64)
    assert cli.main(["serve", tiny_model_path, "--ray", "--replicas", "2", "--devices",
                     "0", "--backend", "numpy"]) == 1
    assert "--devices does not apply to --ray" in capsys.readouterr().err


def test_a_replica_spec_carries_serial_rows_to_its_worker():
    from tinyloop.serve.replica import ReplicaSpec
    spec = ReplicaSpec(model="m.tlm", serial_rows=3)
    assert ReplicaSpec.from_json(spec.to_json()).serial_rows == 3
    assert ReplicaSpec(model="m.tlm").serial_rows == tinyloop.serve.engine.DEFAULT_SERIAL_ROWS
    with pytest.raises(tinyloop.errors.ConfigError, match="serial_rows"):
        ReplicaSpec(model="m.tlm", serial_rows=-1)
