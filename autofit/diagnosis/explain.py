"""Explanations: why each attempt ran out of memory, which fixes apply, and what autofit did next.

`explain(result_or_error)` takes what `autofit.run` returned (a RunResult), the `autofit.DoesNotFit`
it raised, or an evaluation's EvalResult, and writes plain text: for every attempt that ran out of
memory, the memory at the failure by kind, the fixes that the numbers point to (in the words people
use for them: gradient accumulation, AMP, activation checkpointing, freeing a previous optimizer, a
lighter model, keeping batches off the device), and the step-down that followed. The same input
always gives the same text.

The fixes are chosen from the breakdown recorded at the failure (`Attempt.memory`: params, grads,
optimizer, activations, other) and the plan that failed; the thresholds below are the rules.
"""

from __future__ import annotations

from typing import NamedTuple

from autofit.plans.coupling import describe as describe_coupling
from autofit.gpu.memory import KINDS, format_breakdown
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


def fixes_for(memory: dict, plan, budget: int | None = None, where: str = "") -> list[Fix]:
    """The fixes that apply to a failure with this breakdown under this plan, most basic first.
    `where` is the phase that failed (`Attempt.where`): an optimizer step's failure gets the fixes
    for the step, not those for activations (they are gone by then)."""
    if not memory:
        return []
    params, grads, optimizer, activations, other = (int(memory.get(k, 0)) for k in KINDS)
    step = int(memory.get("step", 0))  # the optimizer step's temporaries, for its phases
    # "batch": the global batch autofit read onto the device; part of the step, never the user's
    total = sum(int(memory.get(k, 0)) for k in KINDS) + step + int(memory.get("batch", 0))
    limit = budget or total
    limit_words = f"the {format_size(budget)} budget" if budget else \
        f"the {format_size(total)} in use at the failure"
    out: list[Fix] = []

    # Training state alone: params + grads + optimizer (AdamW's 2x params when not yet allocated).
    own_optimizer = 0 if plan.offload_optimizer else (
        optimizer if 0 < optimizer <= EXCESS_OPTIMIZER * params else ADAMW_STATE * params)
    state = params + max(grads, params) + own_optimizer
    if limit and state >= STATE_SHARE * limit:
        out.append(Fix("lighter-model", "a lighter model variant", (
            f"the parameters ({format_size(params)}) with their gradients"
            f"{'' if plan.offload_optimizer else ' and AdamW state'} need about {format_size(state)} "
            f"before any activation, {_pct(state, limit)} of {limit_words}; no batch size fixes that. "
            f"Take a smaller variant (DistilBERT instead of BERT-base, TinyBERT instead of "
            f"DistilBERT), freeze layers, or train adapters (LoRA) so fewer parameters carry "
            f"gradients and optimizer state.")))

    leftover = _optimizer_leftover(params, optimizer, other)
    if leftover:
        out.append(Fix("free-previous-optimizer", "free a previous optimizer", (
            f"{leftover}; an optimizer from an earlier phase (pretraining "
            f"before fine-tuning, say) is probably still alive. `del optimizer, scheduler` and "
            f"anything else that references them, then `gc.collect(); torch.cuda.empty_cache()`, "
            f"before building the next one.")))

    if other and total and other >= HELD_SHARE * total:
        out.append(Fix("held-tensors", "batches or tensors already on the device", (
            f"{format_size(other)} ({_pct(other, total)}) "
            f"was held outside the step. Keep batches on the CPU (autofit moves each micro-batch "
            f"itself), keep Python numbers (loss.item()) instead of losses or outputs across "
            f"steps, and `del` what the next step does not need; autofit cannot free what your "
            f"code still references.")))

    if where.startswith("optimizer"):
        return out + _step_fixes(where, plan, params, optimizer, step, total)

    big_activations = total and activations >= LARGE_SHARE * total
    if total and activations >= DOMINATE_SHARE * total and plan.micro_batch_size > 1:
        half = plan.micro_batch_size // 2
        steps = -(-plan.global_batch // half)
        out.append(Fix("accumulation", "gradient accumulation", (
            f"activations ({format_size(activations)}, "
            f"{_pct(activations, total)}) dominate and grow with the micro-batch; micro-batches of "
            f"{half} with {steps} accumulation steps keep the global batch and its gradient while "
            f"holding about half the activations.")))
    if big_activations and not precisions.get(plan.precision).mixed:
        out.append(Fix("amp", "mixed precision (AMP)", (
            f"bf16 autocast (fp16 with a GradScaler where bf16 is "
            f"unsupported) keeps activations in 16 bits, roughly halving the "
            f"{format_size(activations)} of activations.")))
    if big_activations and not plan.checkpointing:
        out.append(Fix("checkpointing", "activation checkpointing", (
            f"model.gradient_checkpointing_enable() on Hugging Face models keeps only each layer's "
            f"input and recomputes the rest in backward, trading "
            f"about a third more compute for most of the {format_size(activations)} of activations.")))
    if total and optimizer >= OFFLOAD_SHARE * total and not plan.offload_optimizer:
        out.append(Fix("offload", "optimizer offload", (
            f"its state ({format_size(optimizer)}, {_pct(optimizer, total)}) can "
            f"live in CPU memory and be stepped there, at the cost of host-device copies.")))
    return out


def _step_fixes(where: str, plan, params: int, optimizer: int, step: int, total: int) -> list[Fix]:
    """Fixes for a failure inside optimizer.step(): what lowers the step's own peak."""
    out = []
    if where == "optimizer.step" and step and not plan.per_parameter_step and not plan.offload_optimizer:
        out.append(Fix("per-parameter-step", "a per-parameter optimizer step (foreach=False)", (
            f"the optimizer step itself ran out of memory: its temporaries took {format_size(step)} "
            f"on top of the parameters, gradients and state (a foreach step makes them for every "
            f"parameter at once); foreach=False updates one parameter at a time, so they are one "
            f"parameter's. A smaller micro-batch, AMP or checkpointing would not help: they shrink "
            f"activations, which are gone by the step.")))
    if not plan.offload_optimizer:
        if optimizer:
            what = f"its state ({format_size(optimizer)}, {_pct(optimizer, total)})"
        else:  # the first step failed making it
            what = (f"its state (about {format_size(ADAMW_STATE * params)} for AdamW, which this "
                    f"first step was creating)")
        out.append(Fix("offload", "optimizer offload", (
            f"{what} can live in CPU memory and be stepped there, at the cost of host-device "
            f"copies.")))
    return out


# -- what autofit did ---------------------------------------------------------------------------

_APPLIED = {"accumulation", "amp", "checkpointing", "offload", "per-parameter-step"}


def _changes(old, new) -> tuple[list[str], set]:
    words, keys = [], set()
    if new.micro_batch_size < old.micro_batch_size:
        words.append(f"micro-batch {old.micro_batch_size} -> {new.micro_batch_size} with "
                     f"{new.accumulation_steps} accumulation steps")
        keys.add("accumulation")
    elif new.micro_batch_size > old.micro_batch_size:
        words.append(f"micro-batch {old.micro_batch_size} -> {new.micro_batch_size}")
    if new.precision != old.precision:
        words.append(f"{old.precision} -> {new.precision}")
        if not precisions.get(old.precision).mixed:
            keys.add("amp")
    if new.checkpointing != old.checkpointing:
        words.append("activation checkpointing " + ("on" if new.checkpointing else "off"))
        if new.checkpointing:
            keys.add("checkpointing")
    if new.offload_optimizer != old.offload_optimizer:
        where = "to CPU memory" if new.offload_optimizer else "back on the device"
        words.append(f"optimizer state {where}")
        if new.offload_optimizer:
            keys.add("offload")
    if new.per_parameter_step != old.per_parameter_step:
        words.append("per-parameter optimizer step " + ("on" if new.per_parameter_step else "off"))
        if new.per_parameter_step:
            keys.add("per-parameter-step")
    return words, keys


def _next_attempt(attempts, i):
    a = attempts[i]
    # A Trainer attempt (autofit.integrations.transformers) resumes at a later global step.
    if i + 1 < len(attempts) and (attempts[i + 1].step == a.step or a.where == "trainer.train"):
        return attempts[i + 1]
    return None


def _explain_attempt(attempts, i, number: int, budget, raised: bool, given: set) -> list[str]:
    a = attempts[i]
    where = f" in {a.where}" if a.where else ""
    lines = [f"step {a.step}, attempt {number} ({a.plan.describe()}): out of memory{where}."]
    if a.error:
        lines.append(f"  error: {a.error}")
    nxt = _next_attempt(attempts, i)
    changes, applied = _changes(a.plan, nxt.plan) if nxt is not None else ([], set())
    if a.memory:
        lines.append(f"  memory at the failure: {format_breakdown(a.memory, budget)}")
        fixes = fixes_for(a.memory, a.plan, budget, a.where)
        if fixes:
            lines.append("  fixes that apply:")
            for fix in fixes:
                mark = " [autofit did this next]" if fix.key in applied & _APPLIED else ""
                text = f"{fix.title} (as above)" if fix.key in given else fix.text
                given.add(fix.key)
                lines.append(f"  - {text}{mark}")
        else:
            lines.append("  fixes that apply: none stands out (no kind dominates); a smaller "
                         "micro-batch or a larger budget.")
    else:
        lines.append("  memory at the failure: not recorded.")
    if nxt is not None:
        what = "; ".join(changes) if changes else "the same plan"
        result = "it fitted" if nxt.outcome == "ok" else "it ran out of memory too"
        lines.append(f"  autofit then: {nxt.plan.describe()} ({what}) because {nxt.reason}; {result}.")
    elif raised:
        lines.append("  autofit then: the ladder had no step left, so it raised DoesNotFit; the "
                     "fixes above that a plan cannot make (a lighter model, freeing what your code "
                     "holds) are yours.")
    else:
        lines.append("  autofit then: no later attempt of this step was recorded.")
    return lines


def _explain_eval(attempts) -> list[str]:
    lines = []
    for i, a in enumerate(attempts):
        if a.outcome != "oom":
            continue
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        lines.append(f"evaluation batch {a.batch}: {a.batch_size} rows ran out of memory "
                     f"(sample {a.first_sample} on).")
        if a.error:
            lines.append(f"  error: {a.error}")
        if nxt is not None:
            lines.append(f"  autofit then: evaluated {nxt.batch_size} rows at a time (the evaluation "
                         f"batch halved; the training plan untouched); "
                         f"{'it fitted' if nxt.outcome == 'ok' else 'it ran out of memory too'}.")
        else:
            lines.append("  autofit then: even one row did not fit, so it raised DoesNotFit.")
    return lines


def explain_leaks(leaks) -> list[str]:
    """Lines for the findings of `autofit.diagnosis.leaks.LeakWatch` (dicts: kind, culprit, bytes, fix)."""
    if not leaks:
        return []
    lines = [f"leaks: {len(leaks)} found, memory your code keeps on the device (autofit cannot free "
             f"it):"]
    for leak in leaks:
        lines.append(f"  - {leak['kind']}: {leak['culprit']} ({format_size(leak['bytes'])}).")
        lines.append(f"    fix: {leak['fix']}.")
    return lines


def explain(result_or_error) -> str:
    """Plain text: each out-of-memory attempt, its memory by kind, the fixes, and the step-down."""
    attempts = getattr(result_or_error, "attempts", None)
    if attempts is None:
        raise TypeError(f"explain() takes what autofit.run returned, the autofit.DoesNotFit it raised, "
                        f"or an evaluation result, but got {type(result_or_error).__name__}.")
    attempts = list(attempts)
    budget = getattr(result_or_error, "budget", None)
    raised = isinstance(result_or_error, BaseException)
    training = [a for a in attempts if hasattr(a, "plan")]
    # a run keeps its evaluations' attempts apart (RunResult.eval_attempts, where present)
    evaluation = [a for a in attempts if not hasattr(a, "plan")]
    evaluation += list(getattr(result_or_error, "eval_attempts", None) or [])
    ooms = sum(a.outcome == "oom" for a in attempts)
    eval_ooms = sum(a.outcome == "oom" for a in evaluation)

    lines = []
    if raised:
        lines.append(f"autofit: {str(result_or_error).splitlines()[0]}")
        lines.append(f"{len(attempts)} attempts, {ooms} ran out of memory.")
    elif training:
        steps = len({a.step for a in training})
        plan = getattr(result_or_error, "plan", None)
        tail = f"; the run finished with {plan.describe()}" if plan is not None else ""
        train_ooms = sum(a.outcome == "oom" for a in training)
        lines.append(f"autofit: {len(training)} attempts over {steps} global steps, {train_ooms} ran out "
                     f"of memory{tail}.")
        if evaluation:
            lines.append(f"evaluation: {len(evaluation)} attempts, {eval_ooms} ran out of memory.")
    else:
        lines.append(f"autofit evaluation: {len(evaluation)} attempts, {eval_ooms} ran out of memory.")
    breakdown = getattr(result_or_error, "breakdown", None)
    if raised and not attempts and breakdown and getattr(result_or_error, "plan", None) is not None:
        # Refused by the capacity check before training: explain the estimated memory instead.
        lines.append("The estimate before training, by kind: " + format_breakdown(breakdown, budget))
        lines.extend(f"  - {fix.text}" for fix in fixes_for(breakdown, result_or_error.plan, budget))
        return "\n".join(lines)
    coupled = describe_coupling(getattr(result_or_error, "batch_coupled", None), training)
    if coupled:
        lines.append(coupled)
    leaks = list(getattr(result_or_error, "leaks", None) or [])  # autofit.diagnosis.leaks findings
    lines.extend(explain_leaks(leaks))
    if not any(a.outcome == "oom" for a in training + evaluation):
        lines.append("No attempt ran out of memory; nothing to fix." if not leaks else
                     "No attempt ran out of memory yet; the leaks above hold device memory that a "
                     "longer run or a larger batch will run out of.")
        return "\n".join(lines)

    number, step, given = 0, None, set()
    for i, a in enumerate(training):
        number = number + 1 if a.step == step else 1
        step = a.step
        if a.outcome == "oom":
            last = raised and i == len(training) - 1
            lines.extend(_explain_attempt(training, i, number, budget, last, given))
    lines.extend(_explain_eval(evaluation))
    return "\n".join(lines)
