"""Iteration KV policies (kv_iterations "all" / "latest") and per-token adaptive depth
(depth="auto": Ouro's exit gate, Huginn's KL and state-change rules) on the NumPy backend,
against an incremental float64 forward of the tiny Ouro checkpoint (tests/looped_refs.py) that
is written here from the rules' statements and calls none of tinyloop's functions."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinyloop
from tinyloop import errors
from tinyloop.convert.hf import convert_hf

from .. import looped_refs as L

KL_MAX = 1e-4


@pytest.fixture(scope="module")
def ouro(looped_folders):
    """(config.json dict, tensors, .tlm path at INT8) of the tiny Ouro checkpoint (3 loops,
    layer 1 on a window of 5 positions, an exit gate)."""
    return looped_folders["ouro"][1:]


class OuroOracle:
    """Ouro's forward (looped_refs.ouro_logits) run incrementally over a K/V store.

    ``policy`` "all": layer i at loop l reads and writes store (i, l); "latest": store (i,)
    at every loop, so a position written at loop l is overwritten at loop l + 1 and later
    positions read the last loop's K/V of the earlier ones. A chunk's positions are all
    written before any of them attends (one batched pass per layer). ``mode``: K/V read back
    as that storage mode holds it (looped_refs.stored_kv / stored_h)."""

    def __init__(self, cfg, t, policy="all", mode=None, n=64):
        self.cfg, self.t, self.policy, self.mode = cfg, L.f64(t), policy, mode
        self.eps = cfg["rms_norm_eps"]
        self.k, self.v = {}, {}
        self.n = n

    def store(self, i, loop):
        key = (i, loop) if self.policy == "all" else (i,)
        if key not in self.k:
            shape = (self.n, self.cfg["num_key_value_heads"], self.cfg["head_dim"])
            self.k[key], self.v[key] = np.zeros(shape), np.zeros(shape)
        return key

    def attention(self, p, i, loop, h, pos0):
        cfg, t = self.cfg, self.t
        T = len(h)
        H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        pos, theta = np.arange(pos0, pos0 + T), cfg["rope_theta"]
        hk = L.stored_h(h, self.mode)
        q = L.rope_half((h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd), pos, theta)
        k = L.rope_half((hk @ t[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, hd), pos,
                        theta)
        v = (hk @ t[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, hd)
        k, v = L.stored_kv(k, v, self.mode)
        key = self.store(i, loop)
        self.k[key][pos0:pos0 + T], self.v[key][pos0:pos0 + T] = k, v
        keys, vals = self.k[key][:pos0 + T], self.v[key][:pos0 + T]
        win = cfg["sliding_window"] if cfg["layer_types"][i] == "sliding_attention" else None
        out = np.zeros((T, H, hd))
        g = H // Hkv
        for a in range(T):
            qp = pos0 + a
            lo = max(0, qp - win + 1) if win else 0
            for hh in range(H):
                s = keys[lo:qp + 1, hh // g] @ q[a, hh] / math.sqrt(hd)
                w = np.exp(s - s.max())
                out[a, hh] = (w / w.sum()) @ vals[lo:qp + 1, hh // g]
        return out.reshape(T, H * hd) @ t[p + "self_attn.o_proj.weight"].T

    def loop(self, x, pos0, loop):
        """One pass of the layer stack over rows x (the state entering it), un-normed out."""
        t, eps = self.t, self.eps
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = L.rms(x, t[p + "input_layernorm.weight"], eps)
            x = x + L.rms(self.attention(p, i, loop, h, pos0), t[p + "input_layernorm_2.weight"],
                          eps)
            h = L.rms(x, t[p + "post_attention_layernorm.weight"], eps)
            m = (L.silu(h @ t[p + "mlp.gate_proj.weight"].T)
                 * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
            x = x + L.rms(m, t[p + "post_attention_layernorm_2.weight"], eps)
        return x

    def normed(self, x):
        return L.rms(x, self.t["model.norm.weight"], self.eps)

    def logits(self, x):
        return self.normed(x) @ self.t["lm_head.weight"].T

    def forward(self, ids, pos0, depth):
        """Fixed depth over rows pos0..: logits [T, vocab]."""
        x = self.t["model.embed_tokens.weight"][np.asarray(ids)]
        for lp in range(depth):
            x = self.loop(x if lp == 0 else self.normed(x), pos0, lp)
        return self.logits(x)

    def prefill(self, ids, depth, chunk):
        """The prompt in chunks ending at absolute multiples of ``chunk`` (0: one chunk)."""
        rows, step = [], chunk or len(ids)
        for a in range(0, len(ids), step):
            rows.append(self.forward(ids[a:a + step], a, depth))
        return np.concatenate(rows)

    def step_auto(self, token, pos, rule, threshold, max_depth):
        """One decode position at adaptive depth. After loop l (depth l + 1 < max_depth):
        gate: lambda = sigmoid(w . norm(x) + b), exit probability p = lambda * (what earlier
        loops left), exit once the summed p reaches the threshold (Ouro); kl: KL(p_prev ||
        p_now) of the next-token distributions, p_prev uniform before loop 1, exit below the
        threshold (Huginn); state: |x_now - x_prev| / |x_now| of the state leaving the loop
        (x_prev the state entering loop 1), exit below the threshold. Under "all" the exit
        loop's K/V fills the deeper loops' stores at this position. Returns (logits, depth)."""
        t = self.t
        x = t["model.embed_tokens.weight"][[token]]
        prev_x = x.copy()
        vocab = t["lm_head.weight"].shape[0]
        prev_lp = np.full(vocab, -math.log(vocab))
        cdf, left = 0.0, 1.0
        depth = max_depth
        for lp in range(max_depth):
            x = self.loop(x if lp == 0 else self.normed(x), pos, lp)
            if lp + 1 == max_depth:
                break
            if rule == "gate":
                z = float(self.normed(x)[0] @ t["model.early_exit_gate.weight"][0]
                          + t["model.early_exit_gate.bias"][0])
                lam = 1.0 / (1.0 + math.exp(-z))
                cdf += lam * left
                left *= 1.0 - lam
                stop = cdf >= threshold
            elif rule == "kl":
                z = self.logits(x)[0]
                lpr = z - z.max() - np.log(np.exp(z - z.max()).sum())
                stop = float(np.sum(np.exp(prev_lp) * (prev_lp - lpr))) < threshold
                prev_lp = lpr
            else:
                stop = float(np.linalg.norm(x - prev_x) / np.linalg.norm(x)) < threshold
                prev_x = x.copy()
            if stop:
                depth = lp + 1
                break
        if self.policy == "all":
            for i in range(self.cfg["num_hidden_layers"]):
                src = self.store(i, depth - 1)
                for lp in range(depth, max_depth):
                    dst = self.store(i, lp)
                    self.k[dst][pos], self.v[dst][pos] = self.k[src][pos], self.v[src][pos]
        return self.logits(x)[0], depth


def _ids(n, vocab, seed=1):
    return np.random.default_rng(seed).integers(3, vocab, n)


def _greedy(oracle, ids, depth, chunk, n_new):
    """Greedy tokens of the oracle: prefill at ``depth`` then one decode position at a time."""
    rows = oracle.prefill(ids, depth, chunk)
    out, nxt = [], int(np.argmax(rows[-1]))
    for k in range(n_new):
        if nxt == oracle.cfg["eos_token_id"]:          # generate stops there
            break
        out.append(nxt)
        if k + 1 < n_new:
            nxt = int(np.argmax(oracle.forward([nxt], len(ids) + k, depth)[0]))
    return out


# --- iteration KV policies -------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("mode", ["fp16", "int8", "h_fp16"])
def test_latest_matches_the_rule_and_all_stays_as_it_was(ouro, chunk, mode):
    cfg, t, tlm = ouro
    ids = _ids(20, cfg["vocab_size"])
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=chunk)
    bound = KL_MAX if mode != "int8" else 1e-3
    try:
        for depth in (1, 2, 3):
            want = OuroOracle(cfg, t, "latest", mode).prefill(ids, depth, chunk)
            got = m.logits(ids, depth=depth, kv_mode=mode, kv_iterations="latest")
            assert L.kl_rows(want, got).max() <= bound, (depth, mode)
            # "all" is bit for bit what the forward gave before the policy existed: the
            # default, an explicit "all", and a cache at its own depth agree exactly
            a = m.logits(ids, depth=depth, kv_mode=mode)
            assert np.array_equal(a, m.logits(ids, depth=depth, kv_mode=mode,
                                              kv_iterations="all"))
            assert L.kl_rows(OuroOracle(cfg, t, "all", mode).prefill(ids, depth, chunk),
                             a).max() <= bound
        # within one chunk every position reads the current loop's K/V under both policies;
        # across chunks the later chunk reads the earlier one's last loop under "latest"
        kl = L.kl_rows(OuroOracle(cfg, t, "all").prefill(ids, 3, chunk),
                       OuroOracle(cfg, t, "latest").prefill(ids, 3, chunk)).max()
        assert (kl > 1e-3) if chunk else (kl == 0.0)
    finally:
        tinyloop.free_model(m)


def test_latest_decode_reads_the_last_iteration_of_earlier_tokens(ouro):
    cfg, t, tlm = ouro
    ids = _ids(10, cfg["vocab_size"], seed=2)
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, kv_iterations="latest")
    try:
        assert m.kv_iterations == "latest"
        got = m.generate(ids, max_new_tokens=8, depth=3, stop=[]).token_ids
        assert got == _greedy(OuroOracle(cfg, t, "latest"), ids, 3, 0, 8)
        # a decode position reads the earlier positions' last loop: its logits differ from
        # "all", where loop l reads loop l
        seq = list(ids) + got[:1]
        lat, full = OuroOracle(cfg, t, "latest"), OuroOracle(cfg, t, "all")
        lat.prefill(ids, 3, 0)
        full.prefill(ids, 3, 0)
        assert L.kl_rows(lat.forward(seq[-1:], len(ids), 3),
                         full.forward(seq[-1:], len(ids), 3)).max() > 1e-3
    finally:
        tinyloop.free_model(m)


def test_kv_bytes_and_slots_per_policy(ouro):
    cfg, t, tlm = ouro
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        c = m.config
        one = 2 * c.n_kv_heads * c.head_dim * 4          # fp16 mode stores float32 here
        for depth in (1, 2, 3):
            assert m.kv_bytes_per_token(depth) == one * c.n_slots(depth)
            assert m.kv_bytes_per_token(depth, kv_iterations="latest") == one * c.n_slots(1)
            with m.new_kv_cache(depth, 40, kv_iterations="latest") as cache:
                assert cache.n_slots == c.n_prelude + c.n_recurrent + c.n_coda
                cache.ensure(40)
                assert cache.nbytes == (cache.table_block.nbytes + cache.n_slots * 2
                                        * m.kv_page_layout("fp16").page_bytes)
        with pytest.raises(errors.ConfigError, match="kv_iterations"):
            m.new_kv_cache(2, 8, kv_iterations="first_last")
        with pytest.raises(errors.ConfigError, match="kv_iterations"):
            m.generate([5, 6], max_new_tokens=1, kv_iterations="bogus")
        with pytest.raises(errors.ConfigError, match="latest"):
            m.resume_handle([5, 6, 7], depth=1, kv_iterations="latest")
        pc = m.prefill([5, 6, 7], depth=2)
        try:
            assert pc.kv_iterations == "all"
            with pytest.raises(errors.ConfigError, match="differs from the prefix"):
                m.generate([5, 6, 7, 8], max_new_tokens=1, prefix=pc, kv_iterations="latest")
        finally:
            pc.release()
    finally:
        tinyloop.free_model(m)
    with pytest.raises(errors.ConfigError, match="kv_iterations"):
        tinyloop.load_model(tlm, backend="numpy", kv_iterations="none")


def test_inspect_and_diagnostics_report_bytes_per_policy(ouro, capsys):
    from diagnostics.kvmodes import kv_mode_table
    from tinyloop import cli
    cfg, t, tlm = ouro
    assert cli.main(["inspect", tlm, "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=8)
    try:
        c = m.config
        per_slot = 2 * c.n_kv_heads * c.head_dim * 4             # fp16 mode: float32 K/V
        section = out.split("per iteration policy")[1].split("\n\n")[0].splitlines()
        rows = {line[:18].strip(): line[18:].split() for line in section[2:]}
        assert rows["latest"][0] == str(c.n_slots(1))
        assert int(rows["latest"][1].replace(",", "")) == c.n_slots(1) * per_slot
        assert int(rows[f"all, depth {c.max_depth}"][1].replace(",", "")) == \
            c.n_slots(c.max_depth) * per_slot
        table = kv_mode_table(c, [1, c.max_depth], backend="numpy")
        fp16 = [r for r in table["rows"] if r["mode"] == "fp16"][0]
        assert fp16["bytes_per_token_latest"] == {"1": c.n_slots(1) * per_slot,
                                                  str(c.max_depth): c.n_slots(1) * per_slot}
        assert fp16["bytes_per_token"][str(c.max_depth)] == c.n_slots(c.max_depth) * per_slot
    finally:
        tinyloop.free_model(m)


# --- depth="auto" ----------------------------------------------------------------------------
def _greedy_auto(oracle, ids, rule, threshold, top, chunk, n_new):
    """The oracle's greedy tokens and their depths at depth="auto": the prompt at ``top``,
    then each decode position through :meth:`OuroOracle.step_auto`."""
    rows = oracle.prefill(ids, top, chunk)
    out, depths = [], []
    nxt, d = int(np.argmax(rows[-1])), top
    for k in range(n_new):
        if nxt == oracle.cfg["eos_token_id"]:          # generate stops there
            break
        out.append(nxt)
        depths.append(d)
        if k + 1 < n_new:
            logits, d = oracle.step_auto(nxt, len(ids) + k, rule, threshold, top)
            nxt = int(np.argmax(logits))
    return out, depths


# thresholds at which the oracle's 12 decode positions of _ids(12, seed=6) exit at more than
# one depth under both policies
MIXED = [("gate", 0.7), ("kl", 3.0), ("state", 0.8)]


@pytest.mark.parametrize("policy", ["all", "latest"])
@pytest.mark.parametrize("rule,threshold", MIXED)
def test_auto_depth_follows_the_rule_token_by_token(ouro, rule, threshold, policy):
    cfg, t, tlm = ouro
    ids = _ids(12, cfg["vocab_size"], seed=6)
    want, want_depths = _greedy_auto(OuroOracle(cfg, t, policy), ids, rule, threshold, 3, 0,
                                     12)
    assert len(set(want_depths[1:])) > 1            # the rule really picks several depths
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        r = m.generate(ids, max_new_tokens=12, depth="auto", exit_rule=rule,
                       exit_threshold=threshold, max_depth=3, kv_iterations=policy, stop=[])
        assert r.token_ids == want
        assert r.depths == want_depths and r.depth == 3
        assert r.mean_depth == pytest.approx(sum(want_depths) / 12)
        # one list of compared statistics per decode position run (the last token is not
        # fed back): as many checks as iterations before the exit, none after max_depth
        vals = r.extra["exit_values"]
        assert r.extra["exit_rule"] == (rule, threshold, 3) and len(vals) == 11
        for k, v in enumerate(vals):
            assert len(v) == min(r.depths[k + 1], 2)
        # the stream yields the same tokens, and its result the same depths
        s = m.stream(ids, max_new_tokens=12, depth="auto", exit_rule=rule,
                     exit_threshold=threshold, max_depth=3, kv_iterations=policy, stop=[])
        assert [tok.token_id for tok in s] == want and s.result.depths == want_depths
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("rule", ["gate", "kl", "state"])
def test_thresholds_at_the_ends_give_the_min_and_max_depth(ouro, rule):
    cfg, t, tlm = ouro
    ids = [int(i) for i in _ids(12, cfg["vocab_size"], seed=6)]
    # the gate exits once its cumulative probability reaches the threshold; KL and the state
    # change exit once they fall below it
    shallow, deep = (0.0, math.inf) if rule == "gate" else (math.inf, 0.0)
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        for policy in ("all", "latest"):
            fixed = m.generate(ids, max_new_tokens=8, depth=3, kv_iterations=policy, stop=[])
            r = m.generate(ids, max_new_tokens=8, depth="auto", exit_rule=rule,
                           exit_threshold=deep, kv_iterations=policy, stop=[])
            assert r.token_ids == fixed.token_ids and r.depths == [3] * 8
            assert fixed.depths == [3] * 8 and fixed.mean_depth == 3.0
        r = m.generate(ids, max_new_tokens=8, depth="auto", exit_rule=rule,
                       exit_threshold=shallow, stop=[])
        assert r.depths == [3] + [1] * 7
        # loop 0's K/V of the prompt does not depend on the loops after it, so past the first
        # token this is depth 1 continuing from the depth-3 prompt's first token
        cont = m.generate(ids + r.token_ids[:1], max_new_tokens=7, depth=1, stop=[])
        assert r.token_ids[1:] == cont.token_ids
    finally:
        tinyloop.free_model(m)


def test_auto_depth_arguments_are_checked(ouro, tmp_path):
    cfg, t, tlm = ouro
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        bad = [dict(depth="auto", exit_rule="entropy", exit_threshold=0.1),
               dict(depth="auto", exit_rule="gate"),              # Ouro's code has no default
               dict(depth="auto", exit_rule="kl", exit_threshold=-1.0),
               dict(depth="auto", exit_rule="kl", exit_threshold=float("nan")),
               dict(depth="auto", exit_rule="kl", max_depth=4),
               dict(depth="auto", exit_rule="kl", max_depth=0),
               dict(depth=2, exit_rule="kl"),
               dict(depth=2, exit_threshold=0.5)]
        for kw in bad:
            with pytest.raises(errors.ConfigError) as e:
                m.generate([5, 6, 7], max_new_tokens=2, **kw)
            assert any(k in str(e.value) for k in ("exit_rule", "exit_threshold", "max_depth"))
        with pytest.raises(errors.ConfigError, match="auto"):
            m.logits([5, 6, 7], depth="auto")
        pc = m.prefill([5, 6, 7], depth=3)
        try:
            with pytest.raises(errors.ConfigError, match="auto"):
                m.generate([5, 6, 7, 8], max_new_tokens=2, depth="auto", exit_rule="kl",
                           prefix=pc)
        finally:
            pc.release()
        # the KL rule's state copy and the request's cache go back to the pool
        m.generate([5, 6, 7], max_new_tokens=1)                # the lazy logit row
        before = m.pool.stats().allocated_bytes
        m.generate([5, 6, 7], max_new_tokens=3, depth="auto", exit_rule="kl")
        assert m.pool.stats().allocated_bytes == before
    finally:
        tinyloop.free_model(m)
    # a model without an exit gate refuses the gate rule and defaults to "kl"
    cfg2, t2 = L.huginn_checkpoint(0)
    L.save(str(tmp_path / "h"), cfg2, t2)
    convert_hf(str(tmp_path / "h"), str(tmp_path / "h.tlm"), bits=8)
    h = tinyloop.load_model(str(tmp_path / "h.tlm"), backend="numpy", max_seq_len=32)
    try:
        with pytest.raises(errors.ConfigError, match="exit gate"):
            h.generate([5, 6, 7], max_new_tokens=2, depth="auto", exit_rule="gate",
                       exit_threshold=0.5)
        r = h.generate([5, 6, 7], max_new_tokens=4, depth="auto", exit_threshold=math.inf,
                       stop=[])
        assert r.depths == [h.config.max_depth] + [1] * 3
    finally:
        tinyloop.free_model(h)


def test_a_prefix_prefilled_at_auto_is_keyed_by_its_rule(ouro):
    cfg, t, tlm = ouro
    ids = [int(i) for i in _ids(12, cfg["vocab_size"], seed=6)]
    rule = dict(exit_rule="gate", exit_threshold=0.7, max_depth=3)
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64)
    try:
        want = m.generate(ids, max_new_tokens=10, depth="auto", stop=[], **rule)
        pc = m.prefill(ids[:8], depth="auto", **rule)
        try:
            assert pc.exit_key == ("gate", 0.7, 3) and pc.depth == 3
            # the request takes the prefix's rule, or names the same one
            for kw in ({}, dict(depth="auto", **rule)):
                got = m.generate(ids, max_new_tokens=10, prefix=pc, stop=[], **kw)
                assert got.token_ids == want.token_ids and got.depths == want.depths
                assert got.cached_tokens == 8
            for kw in (dict(depth="auto", exit_rule="gate", exit_threshold=0.6, max_depth=3),
                       dict(depth="auto", exit_rule="kl", max_depth=3), dict(depth=3)):
                with pytest.raises(errors.ConfigError, match="prefilled at depth='auto'"):
                    m.generate(ids, max_new_tokens=2, prefix=pc, **kw)
        finally:
            pc.release()
        fixed = m.prefill(ids[:8], depth=3)
        try:
            assert fixed.exit_key is None
            with pytest.raises(errors.ConfigError, match="fixed depth"):
                m.generate(ids, max_new_tokens=2, prefix=fixed, depth="auto", **rule)
        finally:
            fixed.release()
        with pytest.raises(errors.ConfigError, match="resume_handle takes a fixed depth"):
            m.resume_handle(ids[:8], depth="auto")
        pool = tinyloop.PrefixPool(m)
        try:
            with pytest.raises(errors.ConfigError, match="prefix_pool"):
                m.generate(ids, max_new_tokens=2, prefix_pool=pool, depth="auto", **rule)
        finally:
            pool.release()
    finally:
        tinyloop.free_model(m)


def test_prefix_and_pool_under_latest_reuse_whole_chunks(ouro, tmp_path):
    """Under "latest" a request reuses cached positions up to a multiple of the chunk rows, so
    its tokens are those of its uncached run; the pool keys entries by policy and accounts
    their P + R + C slots."""
    cfg, t, tlm = ouro
    ids = [int(i) for i in _ids(20, cfg["vocab_size"], seed=6)]
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, prefill_chunk=8)
    try:
        assert m.chunk_rows == 8
        want = m.generate(ids, max_new_tokens=6, depth=3, kv_iterations="latest", stop=[])
        assert want.token_ids == _greedy(OuroOracle(cfg, t, "latest"), ids, 3, 8, 6)
        for n, reused in ((13, 8), (16, 16), (7, 0)):
            pc = m.prefill(ids[:n], depth=3, kv_iterations="latest")
            try:
                assert pc.kv_iterations == "latest"
                got = m.generate(ids, max_new_tokens=6, prefix=pc, stop=[])
                assert got.token_ids == want.token_ids and got.cached_tokens == reused
                with pytest.raises(errors.ConfigError, match="latest"):
                    pc.save(str(tmp_path / "p.tlpx"))
            finally:
                pc.release()
        pool = tinyloop.PrefixPool(m)
        try:
            runs = [m.generate(ids, max_new_tokens=6, depth=3, prefix_pool=pool,
                               kv_iterations=policy, stop=[])
                    for policy in ("latest", "latest", "all")]
            assert [r.cached_tokens for r in runs] == [0, 16, 0]
            assert runs[0].token_ids == runs[1].token_ids == want.token_ids
            st = pool.stats()
            assert st["entries"] == 2 and st["hit_tokens"] == 16
            # the two entries share no page: their bytes add up, each at its own slot count
            lat = pool.entry_bytes(20, 3, kv_iterations="latest")
            full = pool.entry_bytes(20, 3, kv_iterations="all")
            assert st["bytes"] == lat + full
            c = m.config
            page = m.kv_page_layout("fp16").page_bytes
            # 20 positions: one page per slot; both block tables round to one 512-byte block
            assert full - lat == (c.n_slots(3) - c.n_slots(1)) * page
            assert pool.key(ids, 3, kv_iterations="latest") != pool.key(ids, 3)
            assert pool.key(ids, 3) == pool.key(ids, 3, kv_iterations="all")
        finally:
            pool.release()
    finally:
        tinyloop.free_model(m)


@pytest.mark.parametrize("mode", ["int8", "h_fp16"])
def test_auto_depth_copies_what_each_storage_mode_stores(ouro, mode):
    """An early exit copies the stored row (int8 codes and scales, or h) into the deeper
    slots: the tokens and depths are the oracle's reading K/V as the mode stores it."""
    cfg, t, tlm = ouro
    ids = _ids(12, cfg["vocab_size"], seed=6)
    want, want_depths = _greedy_auto(OuroOracle(cfg, t, "all", mode), ids, "gate", 0.7, 3, 0,
                                     12)
    assert len(set(want_depths[1:])) > 1
    m = tinyloop.load_model(tlm, backend="numpy", max_seq_len=64, kv_mode=mode)
    try:
        r = m.generate(ids, max_new_tokens=12, depth="auto", exit_rule="gate",
                       exit_threshold=0.7, max_depth=3, stop=[])
        assert r.token_ids == want and r.depths == want_depths
    finally:
        tinyloop.free_model(m)
