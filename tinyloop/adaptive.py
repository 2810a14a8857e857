"""Per-token adaptive depth (``depth="auto"``): the exit rules a decode position applies after
each recurrent iteration, and what an early exit leaves in the K/V cache.

Rules (``exit_rule``), each checked after iterations 1 .. max_depth-1 (a position never runs
past ``max_depth``), all in float64 on the host:

``"gate"``  Ouro's learned exit gate (LoopedLMs/ouro_rl ``modeling_ouro.py``,
            ``OuroForCausalLM.forward``): after loop t the gate reads the loop's normed state,
            lambda_t = sigmoid(w . rmsnorm(x_t) + b) (``early_exit_gate = Linear(hidden, 1)``
            on ``self.norm(hidden_states)``); the exit probability of loop t is
            p_t = lambda_t * prod_{s<t} (1 - lambda_s), and the position exits at the first t
            whose cumulative sum_{s<=t} p_s >= ``exit_threshold`` (``torch.cumsum`` of the exit
            pdf against ``exit_threshold``, ``argmax`` of the mask). Threshold 0 exits after
            loop 1; a threshold above 1 never exits early. Needs a model with the gate
            (``ModelConfig.exit_gate``).
``"kl"``    Huginn's KL rule (seal-rg/recurrent-pretraining ``raven_modeling_minimal.py``,
            ``KLExitEvaluator``): after iteration t the next-token distribution q_t (the
            coda and the head run on a copy of the state) is compared with the previous one,
            KL(q_{t-1} || q_t) (``F.kl_div(log_probs, prev_log_probs, log_target=True)``),
            q_0 uniform over the vocabulary; exit when it is below ``exit_threshold``.
            Threshold 0 never exits early; infinity exits after iteration 1.
``"state"`` Huginn's latent-difference rule (the same file, ``LatentDiffExitEvaluator``):
            |x_t - x_{t-1}|_2 / |x_t|_2 of the residual state leaving iteration t (before a
            loop-boundary norm), x_0 the state entering iteration 1; exit below the
            threshold. Threshold 0 never exits early; infinity exits after iteration 1.

Defaults of ``exit_threshold``: Huginn's ("kl" 1e-3, "state" 0.03, the evaluators' "auto");
Ouro's code has none (``early_exit_threshold`` defaults to None), so "gate" needs one.

What the deeper slots hold for a position that exited after iteration d < max_depth, under
``kv_iterations="all"``: iteration d's K/V (each recurrent layer's stored row) is copied into
the slots of iterations d+1 .. max_depth, so a later position that runs deeper reads, at
iteration t, the exited position's latest K/V: Huginn's ``latest-m4`` lookup (``HuginnDynamicCache
.update``: for a position missing step s, the latest step of the same block position). Under
``"latest"`` the slot already holds it. The coda runs once at the exit, into the coda slots.

Prefill runs every prompt position at ``max_depth``: a chunk's positions run together, so an
exit per position would save no pass of the chunk, and every later position reads the prompt's
K/V (Huginn's ``generate_with_adaptive_compute`` decides the prompt's steps once for the whole
prompt too, on its last position).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ConfigError

EXIT_RULES = ("gate", "kl", "state")
DEFAULT_EXIT_THRESHOLD = {"kl": 1e-3, "state": 0.03}


class ExitRule:
    """One request's exit rule: ``rule`` (EXIT_RULES), ``threshold`` (float >= 0, may be
    infinite), ``max_depth``. :meth:`start` takes the state entering iteration 1; :meth:`exits`
    decides after each iteration. ``values``: per decode position (one list per
    :meth:`start`), the statistic each check compared with the threshold (the cumulative exit
    probability, the KL in nats, or the relative state change), in iteration order."""

    def __init__(self, rule: str, threshold: float, max_depth: int):
        self.rule, self.threshold, self.max_depth = rule, float(threshold), int(max_depth)
        self._prev = None
        self._cdf = self._left = 0.0
        self.values: list[list[float]] = []

    @property
    def key(self) -> tuple:
        """(rule, threshold, max_depth): what a result at depth="auto" depends on."""
        return (self.rule, self.threshold, self.max_depth)

    @property
    def needs_logits(self) -> bool:
        return self.rule == "kl"

    @property
    def needs_start_state(self) -> bool:
        """Whether :meth:`start` reads the state entering iteration 1 (the "state" rule)."""
        return self.rule == "state"

    def start(self, x0, vocab: int) -> None:
        """``x0``: float state [d] entering iteration 1 (the "state" rule's x_0; unread, and
        may be None, for the others: ``needs_start_state``)."""
        self._cdf, self._left = 0.0, 1.0
        self.values.append([])
        if self.rule == "kl":
            self._prev = np.full(vocab, -math.log(vocab))
        elif self.rule == "state":
            self._prev = np.asarray(x0, np.float64).reshape(-1).copy()

    def exits(self, x, gate_z: float | None = None, logits=None) -> bool:
        """After an iteration: ``x`` the state leaving it ([d]), ``gate_z`` the gate's
        pre-sigmoid w . rmsnorm(x) + b ("gate"), ``logits`` the next-token logits [vocab]
        ("kl"). True when the position exits now."""
        if self.rule == "gate":
            lam = 1.0 / (1.0 + math.exp(-gate_z)) if gate_z > -700 else 0.0
            self._cdf += lam * self._left
            self._left *= 1.0 - lam
            self.values[-1].append(self._cdf)
            return self._cdf >= self.threshold
        if self.rule == "kl":
            z = np.asarray(logits, np.float64).reshape(-1)
            z = z - z.max()
            lp = z - math.log(np.exp(z).sum())
            kl = float(np.sum(np.exp(self._prev) * (self._prev - lp)))
            self._prev = lp
            self.values[-1].append(kl)
            return kl < self.threshold
        x = np.asarray(x, np.float64).reshape(-1)
        change = float(np.linalg.norm(x - self._prev) / np.linalg.norm(x))
        self._prev = x.copy()
        self.values[-1].append(change)
        return change < self.threshold


def exit_rule_for(cfg, depth, exit_rule, exit_threshold, max_depth) -> ExitRule | None:
    """The request's ExitRule at ``depth="auto"``, None at a fixed depth. ``exit_rule``:
    EXIT_RULES or None ("gate" when the model has an exit gate, else "kl");
    ``exit_threshold``: a number >= 0 (``math.inf`` allowed) or None (DEFAULT_EXIT_THRESHOLD);
    ``max_depth``: 1..cfg.max_depth or None (the model's). Raises ConfigError naming the bad
    argument, and for exit_rule / exit_threshold / max_depth given at a fixed depth."""
    if depth != "auto":
        if exit_rule is not None or exit_threshold is not None or max_depth is not None:
            raise ConfigError("exit_rule / exit_threshold / max_depth go with depth='auto'")
        return None
    rule = exit_rule
    if rule is None:
        rule = "gate" if cfg.exit_gate else "kl"
    if rule not in EXIT_RULES:
        raise ConfigError(f"unknown exit_rule {exit_rule!r}; expected one of {EXIT_RULES}")
    if rule == "gate" and not cfg.exit_gate:
        raise ConfigError("exit_rule='gate' needs a model with an exit gate (Ouro's "
                          "early_exit_gate); this one has none: use 'kl' or 'state'")
    if exit_threshold is None:
        if rule == "gate":
            raise ConfigError("exit_rule='gate' needs exit_threshold (the cumulative exit "
                              "probability to reach, 0..1)")
        exit_threshold = DEFAULT_EXIT_THRESHOLD[rule]
    if (isinstance(exit_threshold, bool) or not isinstance(exit_threshold, (int, float,
                                                                            np.integer,
                                                                            np.floating))
            or math.isnan(exit_threshold) or exit_threshold < 0):
        raise ConfigError(f"exit_threshold must be a number >= 0, got {exit_threshold!r}")
    top = cfg.max_depth if max_depth is None else max_depth
    if isinstance(top, bool) or not hasattr(top, "__index__") \
            or not 1 <= top.__index__() <= cfg.max_depth:
        raise ConfigError(f"max_depth={max_depth!r} is outside 1..{cfg.max_depth}")
    return ExitRule(rule, float(exit_threshold), top.__index__())
