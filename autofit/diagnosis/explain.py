"""Explanations: why each attempt ran out of memory, which fixes apply, and what autofit did next.

`explain(result_or_error)` takes what `autofit.run` returned (a RunResult), the `autofit.DoesNotFit`
it raised, or an evaluation's EvalResult, and writes plain text: for every attempt that ran out of
memory, the memory at the failure by kind, the fixes that the numbers point to (in the words people
use for them: gradient accumulation, AMP, activation checkpointing, freeing a previous optimizer, a
lighter model, keeping batches off the device), and the step-down that followed. The same input
always gives the same text.

The fixes are chosen by autofit.diagnosis.fixes from the breakdown recorded at the failure and the
plan that failed; a fix whose plan change cannot run for the job is named as not offered, with why.
"""

from __future__ import annotations

from typing import Protocol

from autofit.diagnosis.fixes import fixes_for, withheld
from autofit.plans import switches
from autofit.plans.coupling import describe as describe_coupling
from autofit.sizes import format_breakdown
from autofit.plans import precision as precisions
from autofit.sizes import format_size


# -- what autofit did ---------------------------------------------------------------------------

def _changes(old, new) -> tuple[list[str], set]:
    """The words of what changed from `old` to `new`, and the keys of the fixes (diagnosis/fixes.py)
    the change applied: accumulation, AMP, and each switch's `fix` (plans/switches.py)."""
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
    for switch in switches.SWITCHES:  # each switch's own words (plans/switches.py)
        value = getattr(new, switch.name)
        if value != getattr(old, switch.name) and (said := switch.change(value)) is not None:
            words.append(said)
            if switch.fix is not None and switch.on(new):
                keys.add(switch.fix)
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
        fixes = fixes_for(a.memory, a.plan, budget, a.where, a.unavailable)
        not_offered = withheld(fixes_for(a.memory, a.plan, budget, a.where), a.unavailable)
        if fixes:
            lines.append("  fixes that apply:")
            for fix in fixes:
                mark = " [autofit did this next]" if fix.key in applied else ""  # keys of _changes
                text = f"{fix.title} (as above)" if fix.key in given else fix.text
                given.add(fix.key)
                lines.append(f"  - {text}{mark}")
        else:
            lines.append("  fixes that apply: none stands out (no kind dominates); a smaller "
                         "micro-batch or a larger budget.")
        for fix, why in not_offered:
            lines.append(f"  not offered: {fix.title} ({why}).")
    else:
        lines.append("  memory at the failure: not recorded.")
    if nxt is not None:
        what = "; ".join(changes) if changes else "the same plan"
        result = "it fitted" if nxt.outcome == "ok" else "it ran out of memory too" if nxt.outcome == "oom" \
            else f"it raised {nxt.error}, so that move was withdrawn for the rest of the run"
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


class Explained(Protocol):
    """What explain reads: a RunResult, the DoesNotFit a run raised, an EvalResult."""

    attempts: list


def explain(result_or_error: Explained) -> str:
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
