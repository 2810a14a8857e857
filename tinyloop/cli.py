"""The ``tinyloop`` command: run, generate, serve, convert, inspect.

    tinyloop run [--prompt TEXT] [--backend B] [--depth D] [--max-new-tokens N] ...
        the embedded default model on a default chat prompt: prints the model's path, the text,
        tokens/s and a memory summary
    tinyloop generate [MODEL] PROMPT [--max-new-tokens N] [--depth D] [--temperature T] ...
        MODEL: a .tlm path, a Hugging Face folder (Ouro, Huginn, Nanbeige: converted once into
        the cache), or ``default`` (the embedded model; also used when MODEL is left out);
        [--exit-rule gate|kl|state] [--exit-threshold X]: adaptive depth up to --depth;
        [--kv-iterations all|latest]: the K/V kept per recurrent layer
    tinyloop serve [MODEL] [--host H] [--port P] [--backend B] [--max-seq-len N] [--max-batch B]
        [--queue Q] [--serial-rows N] [--kv-budget SIZE] [--prefix-cache SIZE]
        [--replicas N [--devices 0,1]]
        [--ray [--ray-address ADDR]]
        an OpenAI-compatible HTTP server over a continuous-batching engine (tinyloop.serve);
        --replicas: N worker processes behind a prefix-affinity router; --ray: Ray Serve
    tinyloop convert SRC.gguf DST.tlm [--recurrent A:B] [--default-depth D] [--max-depth M]
        SRC: a .gguf path, or ``default`` (the embedded model's GGUF)
    tinyloop convert DIR DST.tlm [--bits 4|8] [--group-size G] [--max-depth M]
        DIR: a Hugging Face folder (config.json + .safetensors) of Ouro, Huginn or Nanbeige
    tinyloop convert --synthetic DST.tlm [--seed S] [--dims k=v,...]
    tinyloop inspect [MODEL] [--max-seq-len N] [--prefill-chunk C] [--backend B] [--kv-mode M]
        [--kv-budget BYTES]
        MODEL may be a Hugging Face folder: planned from its config.json alone
    tinyloop --version

Also ``python -m tinyloop``. ``--help`` text is plain (no RST markup): every option states its
default. run and generate write the generated text alone to stdout; every ``#`` line (the
model, a note, the timings, the memory summary) and the prefill's progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import numpy as np

from . import __version__
from .adaptive import EXIT_RULES
from .backends import BACKENDS
from .config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEAT_LAST_N, ModelConfig
from .errors import ArtificialLoopWarning, ConfigError, TinyLoopError
from .kv.layouts import KV_ITERATIONS
from .memory.stats import fmt_bytes
from .serve.engine import DEFAULT_SERIAL_ROWS

DEFAULT_PROMPT = "What is a recurrent-depth transformer? Answer in two sentences."
DEFAULT_MODEL = "default"       # MODEL argument naming the embedded default model
DEFAULT_MAX_SEQ_LEN = 2048
# --prefill-chunk when not given, per backend: the NumPy backend prefills a long prompt faster
# in chunks (its attention scores and GEMM operands stay small); CUDA in one pass
DEFAULT_PREFILL_CHUNK = {"numpy": 256, "cuda": 0}
MODEL_HELP = (f"a .tlm file, a Hugging Face folder of Ouro, Huginn or Nanbeige, a llama .gguf "
              f"file (each converted once into the cache folder), or '{DEFAULT_MODEL}': the "
              f"embedded SmolLM2-135M-Instruct, converted once into the cache folder (the "
              f"default when MODEL is left out)")


def note(text: str) -> None:
    """One ``#`` line on stderr, where all of them go."""
    print(f"# {text}", file=sys.stderr, flush=True)


def fmt_value(v) -> str:
    """A header value as a user reads it: a float that is exactly a float32 (the GGUF's own
    precision, e.g. norm_eps) in float32's shortest form, ``1e-05``, not
    ``9.999999747378752e-06``; anything else as str()."""
    if isinstance(v, float) and np.isfinite(v) and float(np.float32(v)) == v:
        return str(np.float32(v))
    return str(v)


def fmt_config(cfg: ModelConfig) -> str:
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in cfg.identity_dict().items())


def resolve_prefill_chunk(a) -> int:
    """``--prefill-chunk`` as given, else the backend's DEFAULT_PREFILL_CHUNK."""
    if a.prefill_chunk is not None:
        return a.prefill_chunk
    from .backends import ops_class
    return DEFAULT_PREFILL_CHUNK[ops_class(a.backend).name]


def resolve_model_arg(model: str | None) -> str:
    """MODEL as given on the command line -> a .tlm path: None or ``default`` is the embedded
    default model (:func:`tinyloop.default_model_path`, converting it on first use); a .gguf
    file is converted once into the cache (:func:`tinyloop.default.model_file`)."""
    if model is None or model == DEFAULT_MODEL:
        from .default import default_model_path
        return default_model_path()
    from .default import model_file
    return model_file(model)


def _add_load_args(p: argparse.ArgumentParser, depth: bool = True,
                   seq_what: str = "positions the KV cache holds: prompt + new tokens",
                   chunk_what: str = "prefill the prompt C tokens at a time; 0 prefills it "
                                     "in one pass") -> None:
    """The options that size a load: depth (unless ``depth`` is False), backend, max_seq_len,
    prefill_chunk; ``seq_what`` / ``chunk_what`` say what the last two mean for the command."""
    if depth:
        p.add_argument("--depth", type=int, default=None, metavar="D",
                       help="recurrent depth: times the recurrent block runs; above the default "
                            "on a model whose loop is artificial, such as the embedded one, the "
                            "text degrades (a # note says so) (default: the model's default "
                            "depth)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: cuda where CuPy sees a GPU, else numpy (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, metavar="N",
                   help=f"{seq_what} (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="C",
                   help=f"{chunk_what} (default: {DEFAULT_PREFILL_CHUNK['numpy']} on the numpy "
                        f"backend, where chunks are faster; {DEFAULT_PREFILL_CHUNK['cuda']} on "
                        "cuda)")


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
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep tokens with probability >= P times the top token's; 0 keeps "
                        "all (default: %(default)s)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0,
                   metavar="R", dest="repetition_penalty",
                   help="divide the positive logits (multiply the negative ones) of tokens "
                        "seen in the last --repeat-last-n positions by R; 1 is off (default: "
                        "%(default)s)")
    p.add_argument("--repeat-last-n", type=int, default=DEFAULT_REPEAT_LAST_N, metavar="N",
                   help="positions (prompt and generated) the repetition penalty looks back "
                        "over; 0 is off (default: %(default)s, as llama.cpp)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the sampler's random draws (default: a fresh seed per run)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode past the end-of-generation tokens, so a run makes "
                        "--max-new-tokens tokens (default: the model's eos and the other "
                        "tokens llama.cpp stops at, such as <|endoftext|>, end the run)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template (default: "
                        "apply the template); an empty prompt is the BOS token alone")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar for a prefill of more than one chunk (default: a "
                        "bar on stderr)")
    p.add_argument("--memory-report", action="store_true",
                   help="print the full memory table (tinyloop.memory_report()) to stderr "
                        "after the one-line summary (default: the summary only)")
    p.add_argument("--exit-rule", choices=EXIT_RULES, default=None,
                   help="adaptive depth (depth='auto'): each new token runs iterations until "
                        "this rule exits (gate: Ouro's exit gate; kl / state: Huginn's), at "
                        "most --depth (default: off, a fixed depth)")
    p.add_argument("--exit-threshold", type=float, default=None, metavar="X",
                   help="the rule's threshold (gate: cumulative exit probability to reach; "
                        "kl: nats; state: relative change; default: Huginn's for kl / state)")
    p.add_argument("--kv-iterations", choices=KV_ITERATIONS, default="all",
                   help="K/V kept per recurrent layer: one slot per iteration (all) or one "
                        "slot every iteration overwrites (latest) (default: %(default)s)")


@contextlib.contextmanager
def prefill_progress(model, n_tokens: int, chunk: int, enabled: bool):
    """A tqdm bar on stderr (a terminal) over the prompt's positions while a prefill of more
    than one chunk runs (``Model.watch_forward`` reports each chunk); closed at the first
    decode step. Nothing when disabled or the prompt fits one chunk."""
    if not enabled or not chunk or n_tokens <= chunk:
        yield
        return
    from tqdm import tqdm
    # disable=None: only on a terminal (a log file gets no carriage-return redraws); every
    # chunk redraws it (a chunk is slow enough that this never floods)
    bar = tqdm(total=n_tokens, desc="# prefill", unit="tok", file=sys.stderr, leave=False,
               dynamic_ncols=True, disable=None, mininterval=0, miniters=1)

    def rows(start: int, t: int) -> None:
        if bar.disable:
            return
        if start >= n_tokens:                 # decode steps: the prefill is over
            bar.close()
            return
        bar.update(min(start + t, n_tokens) - bar.n)

    try:
        with model.watch_forward(rows):
            yield
    finally:
        bar.close()


def memory_summary(model) -> str:
    """One line: what the model owns (once, with its tags), the pool's peak and reserved."""
    from .memory import memory_stats
    st = memory_stats(model.device)
    tags = ", ".join(f"{t} {fmt_bytes(b)}" for t, b in st.by_tag.items() if b)
    return (f"memory on {model.device}: the model owns {fmt_bytes(model.vram_usage_bytes())} "
            f"({tags}); peak allocated {fmt_bytes(st.peak_allocated_bytes)}, reserved "
            f"{fmt_bytes(st.reserved_bytes)} (--memory-report: the full table)")


def cmd_run_like(model_path: str, prompt: str, a, *, default: bool = False) -> int:
    from .memory import memory_report
    from .model import artificial_loop_message, free_model, load_model
    chunk = resolve_prefill_chunk(a)
    model = load_model(model_path, a.max_seq_len, chunk, backend=a.backend,
                       kv_iterations=a.kv_iterations)
    try:
        cfg = model.config
        depth = cfg.check_depth(a.depth if a.exit_rule is None or a.depth is not None
                                else cfg.max_depth)
        auto = {} if a.exit_rule is None else dict(
            depth="auto", exit_rule=a.exit_rule, exit_threshold=a.exit_threshold,
            max_depth=depth)
        ids = prompt
        tok = model.tokenizer
        if not a.raw and tok is not None and tok.chat_template:
            # ids, not text: special-token text typed in the prompt stays plain text
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          tokenize=True)
        ids = model.encode_prompt(ids)
        note(f"{'default ' if default else ''}model: {model_path}")
        note(f"backend {model.backend}, layers P/R/C={cfg.n_prelude}/{cfg.n_recurrent}/"
             f"{cfg.n_coda}, depth {depth}"
             + (f" at most, exit rule {a.exit_rule}" if auto else "")
             + f" (default {cfg.default_depth}, max {cfg.max_depth}), prefill "
             + (f"in chunks of {chunk}" if chunk else "in one pass"))
        if depth > cfg.default_depth and model.loop_is_artificial:
            note("note: " + artificial_loop_message(model, depth) + "; the README says more")
        with prefill_progress(model, len(ids), chunk, not a.no_progress), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", ArtificialLoopWarning)     # noted above
            res = model.generate(ids, max_new_tokens=a.max_new_tokens,
                                 **(auto or dict(depth=depth)),
                                 temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                 seed=a.seed, min_p=a.min_p,
                                 repetition_penalty=a.repetition_penalty,
                                 repeat_last_n=a.repeat_last_n, ignore_eos=a.ignore_eos)
        print(res.text, flush=True)
        at = f"mean depth {res.mean_depth:.2f}" if auto else f"depth {res.depth}"
        note(f"{len(res.prompt_token_ids)} prompt tokens, prefill {res.prefill_ms:.1f} ms; "
             f"{len(res.token_ids)} new tokens at {at}, "
             f"{res.decode_tokens_per_s:.1f} tokens/s decode ({res.finish_reason})")
        note(memory_summary(model))
        if a.memory_report:
            print(memory_report(model.device), file=sys.stderr)
    finally:
        free_model(model)
    return 0


def _check_request_args(a) -> None:
    """Validate the sampling/size options before anything is loaded."""
    from .config import check_load_args
    from .generate import check_sampling
    check_load_args(a.max_seq_len, 0 if a.prefill_chunk is None else a.prefill_chunk)
    check_sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.min_p,
                   a.repetition_penalty, a.repeat_last_n)
    if a.seed is not None and a.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {a.seed}")
    if a.depth is not None and a.depth < 1:
        raise ConfigError(f"--depth must be >= 1, got {a.depth}")
    if a.exit_threshold is not None and a.exit_rule is None:
        raise ConfigError("--exit-threshold goes with --exit-rule (adaptive depth)")


def cmd_run(a) -> int:
    from .default import default_model_path
    _check_request_args(a)
    return cmd_run_like(default_model_path(), DEFAULT_PROMPT if a.prompt is None else a.prompt,
                        a, default=True)


def cmd_generate(a) -> int:
    _check_request_args(a)
    if a.model is None and a.prompt.lower().endswith(".tlm") and os.path.isfile(a.prompt):
        note(f"warning: the only argument, {a.prompt!r}, is a model file, so it is the PROMPT "
             f"for the default model; to generate from it give a prompt too: tinyloop "
             f"generate {a.prompt} \"PROMPT\"")
    return cmd_run_like(resolve_model_arg(a.model), a.prompt, a,
                        default=a.model in (None, DEFAULT_MODEL))


def cmd_serve(a) -> int:
    from .config import check_load_args
    check_load_args(a.max_seq_len, 0 if a.prefill_chunk is None else a.prefill_chunk)
    for name in ("max_batch", "port"):
        if getattr(a, name) < (0 if name == "port" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= "
                              f"{0 if name == 'port' else 1}, got {getattr(a, name)}")
    if a.queue < 0:
        raise ConfigError(f"--queue must be >= 0, got {a.queue}")
    if a.serial_rows < 0:
        raise ConfigError(f"--serial-rows must be >= 0, got {a.serial_rows}")
    if a.replicas is not None and a.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {a.replicas}")
    devices = _parse_devices(a.devices)
    if devices is not None and a.replicas is None:
        raise ConfigError("--devices needs --replicas N (one worker process per replica)")
    try:
        from .serve.http import serve
    except ImportError as e:
        raise ConfigError(f"tinyloop serve needs the serve extra (pip install "
                          f"'tinyloop[serve]'): {e}") from None
    from .model import free_model, load_model
    path = resolve_model_arg(a.model)
    if a.replicas is not None or a.ray:
        return _serve_replicas(a, path, devices)
    model = load_model(path, a.max_seq_len, resolve_prefill_chunk(a), backend=a.backend)
    try:
        note(f"model: {path}; backend {model.backend}; serving on http://{a.host}:{a.port}/v1 "
             f"(max batch {a.max_batch}, queue {a.queue})")
        serve(model, a.host, a.port, max_batch=a.max_batch, max_queue=a.queue,
              kv_budget=a.kv_budget, model_name=a.model_name, prefix_cache=a.prefix_cache,
              serial_rows=a.serial_rows)
    finally:
        free_model(model)
    return 0


def _parse_devices(text):
    """``--devices 0,1,...`` -> ['0', '1', ...] (None when not given); ConfigError naming
    the option otherwise."""
    if text is None:
        return None
    from .serve.replica import device_ids
    return device_ids(text, "--devices")


def _serve_replicas(a, path: str, devices) -> int:
    """``tinyloop serve --replicas N`` (worker processes behind the router) or ``--ray``
    (a Ray Serve application); the workers load the model, this process does not."""
    from .serve.replica import ReplicaSpec
    spec = ReplicaSpec(model=path, backend=a.backend, max_seq_len=a.max_seq_len,
                       prefill_chunk=resolve_prefill_chunk(a), max_batch=a.max_batch,
                       max_queue=a.queue, kv_budget=a.kv_budget, prefix_cache=a.prefix_cache,
                       model_name=a.model_name, serial_rows=a.serial_rows)
    n = a.replicas or 1
    if a.ray:
        if devices is not None:
            raise ConfigError("--devices does not apply to --ray: Ray gives each replica "
                              "one GPU of its own")
        try:
            from .serve.ray_serve import serve_ray
            import ray  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"tinyloop serve --ray needs the ray extra (pip install "
                              f"'tinyloop[ray]'): {e}") from None
        note(f"model: {path}; {n} Ray Serve replica(s) on the {a.backend} backend; serving on "
             f"http://{a.host}:{a.port}/v1")
        serve_ray(spec, n, a.host, a.port, a.ray_address)
        return 0
    try:
        import httpx2  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"tinyloop serve --replicas needs the serve extra (pip install "
                          f"'tinyloop[serve]'): {e}") from None
    from .serve.router import serve_replicas
    note(f"model: {path}; {n} replica processes (backend {a.backend}"
         + (f", devices {','.join(devices)}" if devices else "")
         + f"); the router serves on http://{a.host}:{a.port}/v1")
    serve_replicas(spec, n, a.host, a.port, devices)
    return 0


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
        print(f"wrote {a.src}: {fmt_config(cfg)}")
        return 0
    from .convert import convert
    if os.path.isdir(a.src):
        from .convert.hf import convert_hf
        cfg = convert_hf(a.src, a.dst, bits=a.bits, group_size=a.group_size,
                         state_seed=a.seed, max_depth=a.max_depth)
        print(f"wrote {a.dst}: {fmt_config(cfg)}")
        return 0
    opts = {"default_depth": a.default_depth, "max_depth": a.max_depth}
    if a.recurrent is not None:     # not given: the converter's default for the file
        start, _, end = a.recurrent.partition(":")
        try:
            opts["recurrent"] = (int(start), int(end))
        except ValueError:
            raise TinyLoopError(f"--recurrent must look like A:B (a layer range), got "
                                f"{a.recurrent!r}") from None
    src = a.src
    if src == DEFAULT_MODEL:
        from .default import default_gguf_path
        src = default_gguf_path()
    cfg = convert(src, a.dst, **opts)
    print(f"wrote {a.dst}: {fmt_config(cfg)}")
    return 0


def cmd_inspect(a) -> int:
    from .backends import ops_class
    from .config import check_load_args
    a.prefill_chunk = resolve_prefill_chunk(a)
    check_load_args(a.max_seq_len, a.prefill_chunk)
    a.model = resolve_model_arg(a.model)
    ops = ops_class(a.backend)          # the backend's dtypes; no device needed
    backend = ops.name
    if os.path.isdir(a.model):
        cfg, layout = _inspect_folder(a.model)
    else:
        cfg, layout = _inspect_file(a.model)
    depth = cfg.check_depth(a.depth)
    return _inspect_plan(a, ops, backend, cfg, layout, depth)


def _inspect_folder(src: str):
    """Print a Hugging Face folder's config as the .tlm load_model(DIR) makes of it (INT4,
    group 32); return (config, quant layout)."""
    from .convert.hf import folder_config
    from .format import expected_tensors
    arch, cfg = folder_config(src)
    print(f"folder    {src}  (config.json: {arch}; planned as load_model(DIR) converts it: "
          f"INT4, group 32)")
    for k, v in cfg.identity_dict().items():
        print(f"  {k:<15} {fmt_value(v)}")
    print(f"  slots at default depth {cfg.default_depth}: {cfg.n_slots(cfg.default_depth)}; "
          f"at max depth {cfg.max_depth}: {cfg.n_slots(cfg.max_depth)}")
    layout = {n: (4, 32) for n, (k, _) in expected_tensors(cfg).items() if k == "quant"}
    return cfg, layout


def _inspect_file(path: str):
    """Print a .tlm file's header and dims; return (config, quant layout)."""
    from .format import read_tlm
    with read_tlm(path) as f:
        cfg = f.config
        layout = f.quant_layout()
        print(f"file      {path}  ({fmt_bytes(f.file_size)}, .tlm version {f.version})")
        for k, v in cfg.identity_dict().items():
            print(f"  {k:<15} {fmt_value(v)}")
        print(f"  slots at default depth {cfg.default_depth}: {cfg.n_slots(cfg.default_depth)}; "
              f"at max depth {cfg.max_depth}: {cfg.n_slots(cfg.max_depth)}")
        bits = sorted({b for b, _ in layout.values()})
        groups = sorted({g for _, g in layout.values()})
        print(f"  quantization   INT{'/INT'.join(map(str, bits))}, group {groups}")
        print(f"  metadata       {f.metadata}")
    return cfg, layout


def _inspect_plan(a, ops, backend, cfg, layout, depth) -> int:
    """The memory plan of ``cfg`` on ``backend`` and the KV tables (``tinyloop inspect``)."""
    from . import plan as planmod
    from .config import kv_mode_from_env, parse_size
    from .kv.layouts import H_MODES, resolve_kv_modes
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
    print(f"  phase 1 {'header parse + validation':<24}{0:>14,d}  (reads the header above; no "
          f"memory)")
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
    print(kv_latest_table(cfg, ops.kv_dtype, backend))
    print(kv_depth_table(cfg, ops.kv_dtype, backend))
    return 0


def kv_depths(cfg: ModelConfig) -> list[int]:
    """The depths the per-depth KV table lists: every depth up to 8, else 1, 2, 4, ... and
    the default and maximum depths."""
    if cfg.max_depth <= 8:
        return list(range(1, cfg.max_depth + 1))
    ds = {cfg.default_depth, cfg.max_depth}
    d = 1
    while d < cfg.max_depth:
        ds.add(d)
        d *= 2
    return sorted(ds)


def kv_depth_table(cfg: ModelConfig, kv_dtype, backend: str) -> str:
    """KV cache bytes per token over all slots at each depth (``kv_depths``), per storage
    mode on ``backend`` (page rounding excluded)."""
    import numpy as np
    from .config import KV_MODES
    from .kv.layouts import kv_bytes_per_token
    modes = [m for m in KV_MODES if m not in ("h_int8", "h_int4") or cfg.d_model % 32 == 0]
    lines = [f"\nKV cache bytes per token by depth on backend {backend} (all slots; fp16 "
             f"mode: K/V {np.dtype(kv_dtype).name}; page rounding excluded)",
             f"  {'depth':>5}{'slots':>7}" + "".join(f"{m:>12}" for m in modes)]
    for d in kv_depths(cfg):
        row = "".join(f"{kv_bytes_per_token(cfg, d, (m,) * cfg.n_layers, kv_dtype):>12,d}"
                      for m in modes)
        lines.append(f"  {d:>5}{cfg.n_slots(d):>7}{row}")
    return "\n".join(lines)


def kv_latest_table(cfg: ModelConfig, kv_dtype, backend: str) -> str:
    """KV cache bytes per token under ``kv_iterations="latest"`` (one slot per recurrent layer:
    ``P + R + C`` slots at every depth) per storage mode, beside "all" at the maximum depth."""
    import numpy as np
    from .config import KV_MODES
    from .kv.layouts import kv_bytes_per_token
    modes = [m for m in KV_MODES if m not in ("h_int8", "h_int4") or cfg.d_model % 32 == 0]
    dm = cfg.max_depth
    lines = [f"\nKV cache bytes per token per iteration policy on backend {backend} "
             f"(fp16 mode: K/V {np.dtype(kv_dtype).name}; kv_iterations='latest' holds "
             f"{cfg.n_slots(1)} slots at any depth)",
             f"  {'policy':<16}{'slots':>7}" + "".join(f"{m:>12}" for m in modes)]
    for name, policy, depth in ((f"all, depth {dm}", "all", dm), ("latest", "latest", dm)):
        row = "".join(
            f"{kv_bytes_per_token(cfg, depth, (m,) * cfg.n_layers, kv_dtype, policy):>12,d}"
            for m in modes)
        n = cfg.n_slots(dm) if policy == "all" else cfg.n_slots(1)
        lines.append(f"  {name:<16}{n:>7}{row}")
    return "\n".join(lines)


def kv_mode_table(cfg: ModelConfig, kv_dtype, budget_bytes: int, backend: str) -> str:
    """The KV storage modes side by side on ``backend`` (whose ``kv_dtype`` the fp16 mode
    stores): bytes per token per slot, per token over all slots at depth 1 and at max_depth,
    and the positions that fit in ``budget_bytes`` at each."""
    import numpy as np
    from .config import KV_MODES
    from .kv.layouts import PageLayout, kv_bytes_per_token
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
               "memory budget: bytes, 512M, 4G or 40% of the device), TINYLOOP_FP16_CACHE (0/1: "
               "dequantized weight copies; on by default on the numpy backend, where 0 makes "
               "decode many times slower: see the README).")
    ap.add_argument("--version", action="version", version=f"tinyloop {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="generate with the embedded default model (prints its path)",
                       description="Generate with the embedded default model (SmolLM2-135M-"
                                   "Instruct, converted once into the cache folder) on a "
                                   "default chat prompt; prints the model's path, the text, "
                                   "tokens/s and a memory summary.")
    r.add_argument("--prompt", default=None, metavar="TEXT",
                   help=f"the user message; may be empty (default: {DEFAULT_PROMPT!r})")
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
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)",
                        description="Serve a model over HTTP with the OpenAI API: "
                                    "/v1/completions, /v1/chat/completions (streaming or "
                                    "not), /v1/models, /health, /metrics (Prometheus). "
                                    "Requests are batched continuously; needs the serve "
                                    "extra (pip install 'tinyloop[serve]').")
    sv.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    sv.add_argument("--host", default="127.0.0.1",
                    help="the address to listen on (default: %(default)s, this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="the TCP port (default: %(default)s)")
    _add_load_args(sv, depth=False, seq_what="positions one request holds: prompt + new tokens",
                   chunk_what="the model's scratch rows for a prefill chunk; 0 sizes them for "
                              "the whole sequence")
    sv.add_argument("--max-batch", type=int, default=32, metavar="B",
                    help="requests decoded together in one step (default: %(default)s)")
    sv.add_argument("--serial-rows", type=int, default=DEFAULT_SERIAL_ROWS, metavar="N",
                    help="up to N decoding requests step one after another through the "
                         "captured single-request step instead of one batched step (faster "
                         "at small batches on CUDA; 0: always batch; default: %(default)s)")
    sv.add_argument("--queue", type=int, default=256, metavar="Q",
                    help="requests that may wait for a batch slot or KV memory; beyond them "
                         "a request gets HTTP 429 (default: %(default)s)")
    sv.add_argument("--kv-budget", default=None, metavar="SIZE",
                    help="bytes the running requests' KV caches may take together, e.g. 2G "
                         "(default: the room TINYLOOP_MEMORY_LIMIT leaves, else no bound)")
    sv.add_argument("--prefix-cache", default=None, metavar="SIZE",
                    help="a prefix cache of SIZE bytes (e.g. 256M) shared by every request: "
                         "a prompt that starts like an earlier one prefills only the rest "
                         "(default: none)")
    sv.add_argument("--model-name", default=None, metavar="NAME",
                    help="the model id /v1/models lists (default: the model file's name)")
    sv.add_argument("--replicas", type=int, default=None, metavar="N",
                    help="N worker processes, each a model and an engine of its own, behind "
                         "one router on --host/--port that sends a request to the replica "
                         "holding its prompt's longest prefix, else the least loaded, and "
                         "restarts a replica that dies (default: one engine in this process)")
    sv.add_argument("--devices", default=None, metavar="IDS",
                    help="with --replicas: the GPUs, e.g. 0,1; replica i runs on device "
                         "IDS[i %% len(IDS)] (default: replica i on device i; nothing "
                         "pinned on the numpy backend)")
    sv.add_argument("--ray", action="store_true",
                    help="serve through Ray Serve instead: --replicas actors (one GPU each "
                         "on cuda), Ray's proxy on --host/--port; needs the ray extra "
                         "(default: not Ray)")
    sv.add_argument("--ray-address", default=None, metavar="ADDR",
                    help="with --ray: the Ray cluster to join (default: start a local one)")
    sv.set_defaults(fn=cmd_serve)
    c = sub.add_parser("convert", help="GGUF or Hugging Face folder -> .tlm, or a synthetic "
                       "model",
                       description="Convert a llama-architecture GGUF or a Hugging Face folder "
                                   "of Ouro, Huginn or Nanbeige into a looped .tlm model, "
                                   "or write a synthetic model with random weights.")
    c.add_argument("src", metavar="SRC",
                   help=f"source .gguf, a Hugging Face folder (config.json + .safetensors of "
                        f"Ouro, Huginn or Nanbeige), or '{DEFAULT_MODEL}' for the embedded "
                        f"SmolLM2-135M-Instruct GGUF (with --synthetic: the output .tlm path)")
    c.add_argument("dst", nargs="?", metavar="DST",
                   help="output .tlm path: required without --synthetic, not given with it "
                        "(no default)")
    c.add_argument("--recurrent", default=None, metavar="A:B",
                   help="layers A..B-1 form the recurrent block (default: 10:20 for a llama "
                        "GGUF; a Nanbeige GGUF loops its whole stack)")
    c.add_argument("--default-depth", type=int, default=None, metavar="D",
                   help="depth used when a request names none (default: 1 for a llama GGUF; "
                        "a Nanbeige GGUF's num_loops)")
    c.add_argument("--max-depth", type=int, default=None, metavar="M",
                   help="largest depth a request may ask for (default: 8 for a llama GGUF; a "
                        "Nanbeige GGUF's or a folder's own loop count)")
    c.add_argument("--synthetic", action="store_true",
                   help="write a synthetic model to SRC instead of converting (default: off)")
    c.add_argument("--seed", type=int, default=0, metavar="S",
                   help="with --synthetic: seed of the random weights; with a folder: seed of "
                        "a seeded initial state (Huginn) (default: %(default)s)")
    c.add_argument("--dims", default="", metavar="K=V,...",
                   help="with --synthetic: dims to change, e.g. d_model=256,n_recurrent=4 "
                        "(default: none, SmolLM2-135M's dims)")
    c.add_argument("--bits", type=int, default=4, metavar="B",
                   help="with --synthetic or a folder: weight bits, 4 or 8 (default: "
                        "%(default)s)")
    c.add_argument("--group-size", type=int, default=32, metavar="G",
                   help="with --synthetic or a folder: quantization group size (default: "
                        "%(default)s)")
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
        rc = a.fn(a)
        sys.stdout.flush()          # a closed pipe shows here, not at the interpreter's exit
        return rc
    except BrokenPipeError:
        # the reader of stdout left (tinyloop inspect | head): not an error of ours; stdout
        # goes to devnull so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (TinyLoopError, OSError) as e:
        msg = " ".join(str(e).split("\n"))          # one line, whatever the message holds
        print(f"tinyloop {a.cmd}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
