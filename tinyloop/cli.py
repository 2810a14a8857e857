"""The ``tinyloop`` command: run, generate, convert, inspect.

    tinyloop run [--prompt TEXT] [--backend B] [--depth D] [--max-new-tokens N] ...
        the embedded default model on a default chat prompt: prints the model's path, the text,
        tokens/s and a memory summary
    tinyloop generate [MODEL] PROMPT [--max-new-tokens N] [--depth D] [--temperature T] ...
        MODEL: a .tlm path, or ``default`` (the embedded model; also used when MODEL is left out)
    tinyloop convert SRC.gguf DST.tlm [--recurrent A:B] [--default-depth D] [--max-depth M]
        SRC: a .gguf path, or ``default`` (the embedded model's GGUF)
    tinyloop convert --synthetic DST.tlm [--seed S] [--dims k=v,...]
    tinyloop inspect [MODEL] [--max-seq-len N] [--prefill-chunk C] [--backend B] [--kv-mode M]
        [--kv-budget BYTES]
    tinyloop --version

``--help`` text is plain (no RST markup): every option states its default.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .backends import BACKENDS
from .config import DEFAULT_MAX_NEW_TOKENS, ModelConfig
from .errors import ConfigError, TinyLoopError
from .memory.stats import fmt_bytes

DEFAULT_PROMPT = "What is a recurrent-depth transformer? Answer in two sentences."
DEFAULT_MODEL = "default"       # MODEL argument naming the embedded default model
DEFAULT_MAX_SEQ_LEN = 2048
MODEL_HELP = (f"a .tlm file, or '{DEFAULT_MODEL}': the embedded SmolLM2-135M-Instruct, "
              f"converted once into the cache folder (the default when MODEL is left out)")


def resolve_model_arg(model: str | None) -> str:
    """MODEL as given on the command line -> a .tlm path: None or ``default`` is the embedded
    default model (:func:`tinyloop.default_model_path`, converting it on first use)."""
    if model is None or model == DEFAULT_MODEL:
        from .default import default_model_path
        return default_model_path()
    return model


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """The options that size a load: depth, backend, max_seq_len, prefill_chunk."""
    p.add_argument("--depth", type=int, default=None, metavar="D",
                   help="recurrent depth: times the recurrent block runs (default: the model's "
                        "default depth)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: cuda where CuPy sees a GPU, else numpy (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, metavar="N",
                   help="positions the KV cache holds: prompt + new tokens (default: "
                        "%(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="C",
                   help="prefill the prompt C tokens at a time; 0 prefills it in one pass "
                        "(default: %(default)s)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    _add_load_args(p)
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K most likely tokens; 0 keeps all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens whose probability "
                        "reaches P; 1 keeps all (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the sampler's random draws (default: a fresh seed per run)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template (default: "
                        "apply the template)")


def cmd_run_like(model_path: str, prompt: str, a) -> int:
    from .model import free_model, load_model
    from .memory import memory_report
    model = load_model(model_path, a.max_seq_len, a.prefill_chunk, backend=a.backend)
    try:
        text = prompt
        tok = model.tokenizer
        if not a.raw and tok is not None and tok.chat_template:
            # ids, not text: special-token text typed in the prompt stays plain text
            text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           tokenize=True)
        print(f"# {model!r}", file=sys.stderr)
        res = model.generate(text, max_new_tokens=a.max_new_tokens, depth=a.depth,
                             temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                             seed=a.seed)
        print(res.text)
        print(f"\n# {len(res.prompt_token_ids)} prompt tokens, prefill {res.prefill_ms:.1f} ms; "
              f"{len(res.token_ids)} new tokens at depth {res.depth}, "
              f"{res.decode_tokens_per_s:.1f} tokens/s decode ({res.finish_reason}); "
              f"backend {model.backend}")
        print(f"# model {model_path}: owns {fmt_bytes(model.vram_usage_bytes())}")
        print(memory_report(model.device))
    finally:
        free_model(model)
    return 0


def _check_request_args(a) -> None:
    """Validate the sampling/size options before anything is loaded."""
    from .config import check_load_args
    from .generate import check_sampling
    check_load_args(a.max_seq_len, a.prefill_chunk)
    check_sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p)
    if a.seed is not None and a.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {a.seed}")
    if a.depth is not None and a.depth < 1:
        raise ConfigError(f"--depth must be >= 1, got {a.depth}")


def cmd_run(a) -> int:
    from .default import default_model_path
    if a.prompt is not None and not a.prompt.strip():
        raise ConfigError("--prompt is empty")
    _check_request_args(a)
    path = default_model_path()
    print(f"# default model: {path}", file=sys.stderr)
    return cmd_run_like(path, a.prompt or DEFAULT_PROMPT, a)


def cmd_generate(a) -> int:
    _check_request_args(a)
    return cmd_run_like(resolve_model_arg(a.model), a.prompt, a)


def _parse_dims(text: str) -> dict:
    out = {}
    if not text:
        return out
    for kv in text.split(","):
        k, _, v = kv.partition("=")
        k = k.strip()
        if not _:
            raise TinyLoopError(f"--dims entry {kv!r} is not key=value")
        if v in ("true", "false"):
            out[k] = v == "true"
        else:
            try:
                out[k] = int(v)
            except ValueError:
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v
    return out


def cmd_convert(a) -> int:
    if a.synthetic:
        from .convert.synthetic import SMOLLM2_DIMS, write_synthetic
        if a.dst:
            raise ConfigError("with --synthetic give one path (the output), not SRC and DST")
        if a.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {a.seed}")
        cfg = write_synthetic(a.src, ModelConfig.from_dict({**SMOLLM2_DIMS,
                                                            **_parse_dims(a.dims)}),
                              seed=a.seed, bits=a.bits, group_size=a.group_size)
        print(f"wrote {a.src}: {cfg}")
        return 0
    from .convert import convert
    start, _, end = a.recurrent.partition(":")
    try:
        rec = (int(start), int(end))
    except ValueError:
        raise TinyLoopError(f"--recurrent must look like A:B (a layer range), got "
                            f"{a.recurrent!r}") from None
    src = a.src
    if src == DEFAULT_MODEL:
        from .default import default_gguf_path
        src = default_gguf_path()
    cfg = convert(src, a.dst, recurrent=rec, default_depth=a.default_depth,
                  max_depth=a.max_depth)
    print(f"wrote {a.dst}: {cfg}")
    return 0


def cmd_inspect(a) -> int:
    from . import plan as planmod
    from .backends import ops_class
    from .format import read_tlm
    from .config import check_load_args
    check_load_args(a.max_seq_len, a.prefill_chunk)
    a.model = resolve_model_arg(a.model)
    ops = ops_class(a.backend)          # the backend's dtypes; no device needed
    backend = ops.name
    with read_tlm(a.model) as f:
        cfg = f.config
        depth = cfg.check_depth(a.depth)
        layout = f.quant_layout()
        print(f"file      {a.model}  ({fmt_bytes(f.file_size)}, .tlm version {f.version})")
        for k, v in cfg.to_dict().items():
            print(f"  {k:<15} {v}")
        print(f"  slots at default depth {cfg.default_depth}: {cfg.n_slots(cfg.default_depth)}; "
              f"at max depth {cfg.max_depth}: {cfg.n_slots(cfg.max_depth)}")
        bits = sorted({b for b, _ in layout.values()})
        groups = sorted({g for _, g in layout.values()})
        print(f"  quantization   INT{'/INT'.join(map(str, bits))}, group {groups}")
        print(f"  metadata       {f.metadata}")
    from .config import kv_mode_from_env, parse_size
    from .kvcache import H_MODES, resolve_kv_modes
    modes = resolve_kv_modes(a.kv_mode or kv_mode_from_env(), cfg)
    budget = parse_size(a.kv_budget, name="--kv-budget")
    p = planmod.backend_load_plan(ops, cfg, layout, a.max_seq_len, a.prefill_chunk,
                                  store_h=any(m in H_MODES for m in modes))
    import numpy as np
    act, kv = np.dtype(ops.act_dtype).name, np.dtype(ops.kv_dtype).name
    print(f"\nmemory plan for backend={backend} (activations {act}, fp16-mode K/V {kv}) "
          f"max_seq_len={a.max_seq_len} prefill_chunk={a.prefill_chunk} (bytes before the "
          f"pool's 512-byte rounding; each entry's dtype in its row)")
    by = planmod.plan_bytes_by_phase(p)
    for ph, name in planmod.PHASES.items():
        print(f"  phase {ph} {name:<24}{by.get(ph, 0):>14,d}  {fmt_bytes(by.get(ph, 0))}")
    for e in p:
        if e.phase in (4, 5):
            lazy = " (lazy)" if e.lazy else ""
            print(f"      {e.name:<12}{str(list(e.shape)):<18}{e.dtype:<9}{e.nbytes:>14,d}{lazy}")
    total = sum(e.nbytes for e in p if not e.lazy)
    print(f"  model total{'':<22}{total:>14,d}  {fmt_bytes(total)}  (lazy entries excluded)")
    kv_plan = planmod.request_plan(cfg, a.max_seq_len, depth, ops.kv_dtype, modes=modes)
    kv_total = sum(e.nbytes for e in kv_plan)
    print(f"  per request on {backend}: paged KV cache ({'/'.join(sorted(set(modes)))}; "
          f"fp16-mode K/V {kv}) for "
          f"{a.max_seq_len} positions at depth {depth} ({cfg.n_slots(depth)} slots): "
          f"{kv_total:,d}  {fmt_bytes(kv_total)}")
    print(kv_mode_table(cfg, ops.kv_dtype, budget, backend))
    return 0


def kv_mode_table(cfg: ModelConfig, kv_dtype, budget_bytes: int, backend: str) -> str:
    """The KV storage modes side by side on ``backend`` (whose ``kv_dtype`` the fp16 mode
    stores): bytes per token per slot, per token over all slots at depth 1 and at max_depth,
    and the positions that fit in ``budget_bytes`` at each."""
    import numpy as np
    from .config import KV_MODES
    from .kvcache import PageLayout, kv_bytes_per_token
    d1, dm = 1, cfg.max_depth
    lines = [f"\nKV cache storage modes on backend {backend} (fp16 mode: K/V "
             f"{np.dtype(kv_dtype).name}; page rounding excluded; budget "
             f"{fmt_bytes(budget_bytes)}; python -m diagnostics kvmodes --backend {backend} "
             f"prints what each mode stores)",
             f"  {'mode':<8}{'B/token/slot':>13}{'B/token d=1':>13}{'B/token d=' + str(dm):>14}"
             f"{'pos @ d=1':>12}{'pos @ d=' + str(dm):>12}"]
    for mode in KV_MODES:
        per_slot = PageLayout.for_config(cfg, mode, 1, kv_dtype).bytes_per_token \
            if (mode not in ("h_int8", "h_int4") or cfg.d_model % 32 == 0) else None
        if per_slot is None:
            lines.append(f"  {mode:<8}  (d_model={cfg.d_model} is not a multiple of 32)")
            continue
        b1 = kv_bytes_per_token(cfg, d1, (mode,) * cfg.n_layers, kv_dtype)
        bm = kv_bytes_per_token(cfg, dm, (mode,) * cfg.n_layers, kv_dtype)
        lines.append(f"  {mode:<8}{per_slot:>13,d}{b1:>13,d}{bm:>14,d}"
                     f"{budget_bytes // b1:>12,d}{budget_bytes // bm:>12,d}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tinyloop",
        description="Run quantized looped (recurrent-depth) transformer LMs and account for "
                    "every byte of GPU memory.",
        epilog="Each command has its own --help. Environment: TINYLOOP_MEMORY_LIMIT (a hard "
               "memory budget: bytes, 512M, 4G or 40%%), TINYLOOP_FP16_CACHE (0/1: dequantized "
               "weight copies; on by default on the numpy backend).")
    ap.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="generate with the embedded default model (prints its path)",
                       description="Generate with the embedded default model (SmolLM2-135M-"
                                   "Instruct, converted once into the cache folder) on a "
                                   "default chat prompt; prints the model's path, the text, "
                                   "tokens/s and a memory summary.")
    r.add_argument("--prompt", default=None, metavar="TEXT",
                   help=f"the user message (default: {DEFAULT_PROMPT!r})")
    _add_sampling(r)
    r.set_defaults(fn=cmd_run)
    g = sub.add_parser("generate", help="generate from a .tlm model (default: the embedded one)",
                       description="Generate from a .tlm model. With one positional argument "
                                   "it is the prompt, and the model is the embedded default.")
    g.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    g.add_argument("prompt", metavar="PROMPT",
                   help="the user message (sent through the model's chat template unless "
                        "--raw)")
    _add_sampling(g)
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("convert", help="GGUF -> .tlm, or a synthetic model",
                       description="Convert a llama-architecture GGUF into a looped .tlm model, "
                                   "or write a synthetic model with random weights.")
    c.add_argument("src", metavar="SRC",
                   help=f"source .gguf, or '{DEFAULT_MODEL}' for the embedded SmolLM2-135M-"
                        f"Instruct GGUF (with --synthetic: the output .tlm path)")
    c.add_argument("dst", nargs="?", metavar="DST",
                   help="output .tlm path: required without --synthetic, not given with it "
                        "(no default)")
    c.add_argument("--recurrent", default="10:20", metavar="A:B",
                   help="layers A..B-1 form the recurrent block (default: %(default)s)")
    c.add_argument("--default-depth", type=int, default=1, metavar="D",
                   help="depth used when a request names none (default: %(default)s)")
    c.add_argument("--max-depth", type=int, default=8, metavar="M",
                   help="largest depth a request may ask for (default: %(default)s)")
    c.add_argument("--synthetic", action="store_true",
                   help="write a synthetic model to SRC instead of converting (default: off)")
    c.add_argument("--seed", type=int, default=0, metavar="S",
                   help="with --synthetic: seed of the random weights (default: %(default)s)")
    c.add_argument("--dims", default="", metavar="K=V,...",
                   help="with --synthetic: dims to change, e.g. d_model=256,n_recurrent=4 "
                        "(default: none, SmolLM2-135M's dims)")
    c.add_argument("--bits", type=int, default=4, metavar="B",
                   help="with --synthetic: weight bits, 4 or 8 (default: %(default)s)")
    c.add_argument("--group-size", type=int, default=32, metavar="G",
                   help="with --synthetic: quantization group size (default: %(default)s)")
    c.set_defaults(fn=cmd_convert)
    i = sub.add_parser("inspect", help="header, dims and the memory plan of a model",
                       description="Print a .tlm file's header and dims and the bytes of each "
                                   "load phase and of one request's KV cache.")
    i.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    _add_load_args(i)
    i.add_argument("--kv-mode", default=None,
                   help="KV storage mode to plan with (default: TINYLOOP_KV_MODE or fp16)")
    i.add_argument("--kv-budget", default="1G",
                   help="bytes for the 'positions that fit' columns (default 1G; e.g. 512M)")
    i.set_defaults(fn=cmd_inspect)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "convert" and not a.synthetic and not a.dst:
        print("tinyloop convert: DST is required", file=sys.stderr)
        return 2
    try:
        return a.fn(a)
    except (TinyLoopError, OSError) as e:
        msg = " ".join(str(e).split("\n"))          # one line, whatever the message holds
        print(f"tinyloop {a.cmd}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
