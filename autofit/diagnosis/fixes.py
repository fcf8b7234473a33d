"""Which fixes apply to an out-of-memory failure: chosen from the memory by kind recorded at the
failure (`Attempt.memory`: params, grads, optimizer, activations, other) and the plan that failed, in
the words people use for them (gradient accumulation, AMP, activation checkpointing, optimizer
offload, freeing a previous optimizer, a lighter model, keeping batches off the device). The
thresholds below are the rules. A fix whose plan change cannot run for the job (`Attempt.unavailable`,
by the rule of autofit.plans.applies) is not offered.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from autofit.plans import switches
from autofit.gpu.memory import KINDS
from autofit.plans import precision as precisions
from autofit.sizes import format_size

# The rules, as shares of the memory at the failure (or of the budget, where one is known).
STATE_SHARE = 0.9        # params + grads + optimizer would take this share of the budget: lighter model
ADAMW_STATE = 2.0        # AdamW keeps two moments per parameter
EXCESS_OPTIMIZER = 2.2   # more optimizer state than this many times the params: a second optimizer
LEFTOVER_TOLERANCE = 0.15  # "other" within 15% of 2x params looks like a leftover AdamW's moments
DOMINATE_SHARE = 0.5     # activations at least half: a smaller micro-batch helps most
LARGE_SHARE = 0.3        # activations at least this share: AMP and checkpointing help
HELD_SHARE = 0.1         # "other" at least this share: tensors held outside the step
OFFLOAD_SHARE = 0.25     # optimizer state at least this share: offload helps


class Fix(NamedTuple):
    key: str     # stable name: lighter-model, free-previous-optimizer, held-tensors, accumulation,
                 # amp, checkpointing, offload, per-parameter-step
    title: str   # the fix in the words of the field, e.g. "gradient accumulation"
    detail: str  # why the numbers point to it, and how

    @property
    def text(self) -> str:
        return f"{self.title}: {self.detail}"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole)}%" if whole else "-"


def _optimizer_leftover(params: int, optimizer: int, other: int) -> str | None:
    """Why the numbers suggest an optimizer from an earlier phase is still alive, or None."""
    if params <= 0:
        return None
    if optimizer > EXCESS_OPTIMIZER * params:
        return (f"the optimizer state ({format_size(optimizer)}) is {optimizer / params:.1f}x the "
                f"parameters, more than the {ADAMW_STATE:.0f}x one AdamW keeps")
    adamw = ADAMW_STATE * params
    if other and abs(other - adamw) <= LEFTOVER_TOLERANCE * adamw:
        return (f"memory held outside the step ({format_size(other)}) is about {ADAMW_STATE:.0f}x the "
                f"parameters, the size of an AdamW's two moments")
    return None


# The plan field each fix turns on: the key of `Attempt.unavailable` that withholds it (AMP is the
# precision registry's; the others are the switches' own fix keys, plans/switches.py).
PLAN_FIELDS = {"amp": "precision", **{s.fix: s.name for s in switches.SWITCHES if s.fix is not None}}


def withheld(fixes: list[Fix], unavailable: dict | None) -> list[tuple[Fix, str]]:
    """(fix, why its plan change cannot run for the job) for those of `fixes` that do not apply."""
    unavailable = unavailable or {}
    return [(f, unavailable[PLAN_FIELDS[f.key]]) for f in fixes
            if PLAN_FIELDS.get(f.key) in unavailable]


def fixes_for(memory: dict, plan, budget: int | None = None, where: str = "",
              unavailable: dict | None = None) -> list[Fix]:
    """The fixes that apply to a failure with this breakdown under this plan, most basic first.
    `where` is the phase that failed (`Attempt.where`): an optimizer step's failure gets the fixes
    for the step, not those for activations (they are gone by then). `unavailable`
    (`Attempt.unavailable`: {plan field: why turning it on cannot run for the job}) withholds the
    fixes that change those fields."""
    out = _fixes(memory, plan, budget, where)
    dropped = {id(f) for f, _ in withheld(out, unavailable)}
    return [f for f in out if id(f) not in dropped]


class _Failure(NamedTuple):
    """A failure's memory by kind, in bytes, and what its shares are measured against."""

    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    step: int         # the optimizer step's temporaries, for its phases
    total: int        # everything in use at the failure
    limit: int        # the budget, else the total
    limit_words: str  # what `limit` is, for the message

    @classmethod
    def of(cls, memory: dict, budget) -> "_Failure":
        params, grads, optimizer, activations, other = (int(memory.get(k, 0)) for k in KINDS)
        step = int(memory.get("step", 0))
        # "batch": the global batch autofit read onto the device; part of the step, never the user's
        total = sum(int(memory.get(k, 0)) for k in KINDS) + step + int(memory.get("batch", 0))
        limit_words = f"the {format_size(budget)} budget" if budget else \
            f"the {format_size(total)} in use at the failure"
        return cls(params, grads, optimizer, activations, other, step, total, budget or total, limit_words)


def _fixes(memory: dict, plan, budget, where: str) -> list[Fix]:
    if not memory:
        return []
    failure = _Failure.of(memory, budget)
    rules = _ANY_PHASE + ((partial(_step_fixes, where),) if where.startswith("optimizer") else _ACTIVATION_PHASES)
    return [fix for rule in rules for fix in rule(failure, plan)]


def _lighter_model(f: _Failure, plan) -> list[Fix]:
    """Training state alone: params + grads + optimizer (AdamW's 2x params when not yet allocated)."""
    own_optimizer = 0 if plan.offload_optimizer else (
        f.optimizer if 0 < f.optimizer <= EXCESS_OPTIMIZER * f.params else ADAMW_STATE * f.params)
    state = f.params + max(f.grads, f.params) + own_optimizer
    if not (f.limit and state >= STATE_SHARE * f.limit):
        return []
    return [Fix("lighter-model", "a lighter model variant", (
        f"the parameters ({format_size(f.params)}) with their gradients"
        f"{'' if plan.offload_optimizer else ' and AdamW state'} need about {format_size(state)} "
        f"before any activation, {_pct(state, f.limit)} of {f.limit_words}; no batch size fixes that. "
        f"Take a smaller variant (DistilBERT instead of BERT-base, TinyBERT instead of "
        f"DistilBERT), freeze layers, or train adapters (LoRA) so fewer parameters carry "
        f"gradients and optimizer state."))]


def _previous_optimizer(f: _Failure, plan) -> list[Fix]:
    leftover = _optimizer_leftover(f.params, f.optimizer, f.other)
    if not leftover:
        return []
    return [Fix("free-previous-optimizer", "free a previous optimizer", (
        f"{leftover}; an optimizer from an earlier phase (pretraining "
        f"before fine-tuning, say) is probably still alive. `del optimizer, scheduler` and "
        f"anything else that references them, then `gc.collect(); torch.cuda.empty_cache()`, "
        f"before building the next one."))]


def _held_tensors(f: _Failure, plan) -> list[Fix]:
    if not (f.other and f.total and f.other >= HELD_SHARE * f.total):
        return []
    return [Fix("held-tensors", "batches or tensors already on the device", (
        f"{format_size(f.other)} ({_pct(f.other, f.total)}) "
        f"was held outside the step. Keep batches on the CPU (autofit moves each micro-batch "
        f"itself), keep Python numbers (loss.item()) instead of losses or outputs across "
        f"steps, and `del` what the next step does not need; autofit cannot free what your "
        f"code still references."))]


def _big_activations(f: _Failure) -> bool:
    return bool(f.total) and f.activations >= LARGE_SHARE * f.total


def _accumulation(f: _Failure, plan) -> list[Fix]:
    if not (f.total and f.activations >= DOMINATE_SHARE * f.total and plan.micro_batch_size > 1):
        return []
    half = plan.micro_batch_size // 2
    steps = -(-plan.global_batch // half)
    return [Fix("accumulation", "gradient accumulation", (
        f"activations ({format_size(f.activations)}, "
        f"{_pct(f.activations, f.total)}) dominate and grow with the micro-batch; micro-batches of "
        f"{half} with {steps} accumulation steps keep the global batch and its gradient while "
        f"holding about half the activations."))]


# Each fix below is its own memory rule, so the switches are read by name (not from the registry).
def _amp(f: _Failure, plan) -> list[Fix]:
    if not (_big_activations(f) and not precisions.get(plan.precision).mixed):
        return []
    return [Fix("amp", "mixed precision (AMP)", (
        f"bf16 autocast (fp16 with a GradScaler where bf16 is "
        f"unsupported) keeps activations in 16 bits, roughly halving the "
        f"{format_size(f.activations)} of activations."))]


def _checkpointing(f: _Failure, plan) -> list[Fix]:
    if not (_big_activations(f) and not plan.checkpointing):
        return []
    return [Fix("checkpointing", "activation checkpointing", (
        f"model.gradient_checkpointing_enable() on Hugging Face models keeps only each layer's "
        f"input and recomputes the rest in backward, trading "
        f"about a third more compute for most of the {format_size(f.activations)} of activations."))]


def _offload(f: _Failure, plan) -> list[Fix]:
    if not (f.total and f.optimizer >= OFFLOAD_SHARE * f.total and not plan.offload_optimizer):
        return []
    return [Fix("offload", "optimizer offload", (
        f"its state ({format_size(f.optimizer)}, {_pct(f.optimizer, f.total)}) can "
        f"live in CPU memory and be stepped there, at the cost of host-device copies."))]


def _step_fixes(where: str, f: _Failure, plan) -> list[Fix]:
    """Fixes for a failure inside optimizer.step(): what lowers the step's own peak."""
    out = []
    if where == "optimizer.step" and f.step and not plan.per_parameter_step and not plan.offload_optimizer:
        out.append(Fix("per-parameter-step", "a per-parameter optimizer step (foreach=False)", (
            f"the optimizer step itself ran out of memory: its temporaries took {format_size(f.step)} "
            f"on top of the parameters, gradients and state (a foreach step makes them for every "
            f"parameter at once); foreach=False updates one parameter at a time, so they are one "
            f"parameter's. A smaller micro-batch, AMP or checkpointing would not help: they shrink "
            f"activations, which are gone by the step.")))
    if not plan.offload_optimizer:
        if f.optimizer:
            what = f"its state ({format_size(f.optimizer)}, {_pct(f.optimizer, f.total)})"
        else:  # the first step failed making it
            what = (f"its state (about {format_size(ADAMW_STATE * f.params)} for AdamW, which this "
                    f"first step was creating)")
        out.append(Fix("offload", "optimizer offload", (
            f"{what} can live in CPU memory and be stepped there, at the cost of host-device "
            f"copies.")))
    return out


# The rules in the order their fixes are given, most basic first: these for any failure, then
# the optimizer step's own (activations are gone by then) or those for activations.
_ANY_PHASE = (_lighter_model, _previous_optimizer, _held_tensors)
_ACTIVATION_PHASES = (_accumulation, _amp, _checkpointing, _offload)
