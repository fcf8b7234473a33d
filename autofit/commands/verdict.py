"""The probe's last line: one sentence saying what decides the plan and what the user could change.

It reads the estimates `capacity.rank` made (fastest first) and the fine-tune the probe priced
(plans named as they run on its weights: `finetune.plan_text`):
- the chosen plan offloads the optimizer state: the state's size against the card (plans that keep
  it on the card are not even estimated when the model's states alone exceed the budget);
- the fastest plan fits: it says so, with the largest part of its peak;
- the chosen plan is slower than the fastest (micro-batches, checkpointing, bf16): what the fastest
  plan's peak is mostly made of at the moment it peaks, activations or the model's states; for
  activations, fewer rows (--batch-size), and shorter ones (--seq-len) only where --seq-len sets a
  row's length: not for an image or a window of audio frames, whose size the model's config fixes;
- no plan fits: what the smallest plan cannot lose (parameters, parameters and gradients, or
  activations).
The options it suggests are the ones whose saving, worked out from the estimate's resident bytes
(parameters, gradients, optimizer state), brings the peak within the usable bytes: another
optimizer's state by its bytes per trained parameter, LoRA dropping the base's gradients and state,
bf16 weights halving parameters, gradients and state. That arithmetic leaves the activations as they
were, so the sentence says "by this breakdown": the probe rerun with the option is the answer. An
option that needs a package not installed (8-bit AdamW: bitsandbytes; LoRA: peft) says so.
"""

from __future__ import annotations

from autofit.commands.finetune import NEEDS, OPTIMIZER_NAMES, installed, plan_text
from autofit.sizes import format_size

# Optimizer state per trained parameter (fp32 weights), heaviest first: the suggestion is the
# heaviest lighter optimizer that fits. 8-bit AdamW: two uint8 moments and an fp32 absmax per 256.
STATE_BYTES = {"adamw": 8.0, "sgd-momentum": 4.0, "adamw8bit": 2 + 8 / 256, "sgd": 0.0}


def sentence(result: dict, candidates, chosen) -> str | None:
    """The verdict for a probe `result` (its JSON fields) and what `capacity.rank` returned."""
    if not candidates:
        return None
    usable = result["usable_bytes"]
    name = OPTIMIZER_NAMES[result["optimizer"]]

    def words(candidate) -> str:  # the plan as it runs on the fine-tune's weights
        return plan_text(candidate.plan, result["weights"])
    if chosen is not None and chosen.plan.offload_optimizer:
        state, states = _resident(chosen)["optimizer"], _model_states(chosen, with_state=False)
        if state > usable:
            what = f"{name} state alone ({_s(state)}) exceeds the card's {_s(usable)} usable: every fitting plan"
        elif state + states > usable:
            what = (f"{name} state ({_s(state)}) with parameters and gradients ({_s(states)}) exceeds the "
                    f"card's {_s(usable)} usable: every fitting plan")
        else:
            what = (f"Parameters, gradients and {name} state ({_s(state + states)}) leave too little of the "
                    f"card's {_s(usable)} usable for the activations: the plan")
        return f"{what} offloads the state to host memory{_options(result, chosen, 'fit without offload')}."
    if chosen is candidates[0]:
        kind, size = _largest(chosen.estimate)
        return (f"The fastest plan fits: {words(chosen)} reserves {_s(_reserved(chosen))} of the "
                f"{_s(usable)} usable, {kind} the largest part ({_s(size)}); nothing needs to change.")
    if chosen is not None:
        faster = next(c for c in candidates if not c.fits)  # the fastest plan, which did not fit
        activations = faster.estimate.breakdown.get("activations", 0)
        states = _model_states(faster, with_state=True)
        if activations >= states:
            return (f"Activations decide the plan: {words(faster)} would hold {_s(activations)} of "
                    f"them and reserve {_s(_reserved(faster))} of the {_s(usable)} usable, so it runs "
                    f"{words(chosen)}; {_fewer_activations(result['batch'])}.")
        return (f"The model's states decide the plan: parameters, gradients and {name} state take "
                f"{_s(states)} of the {_s(usable)} usable, so it runs {words(chosen)}"
                f"{_options(result, faster, 'let a faster plan fit')}.")
    smallest = min(candidates, key=_reserved)
    resident = _resident(smallest)
    if resident["params"] > usable:
        what = f"Parameters alone ({_s(resident['params'])}) exceed the {_s(usable)} usable"
    elif resident["params"] + resident["grads"] > usable:
        what = (f"Parameters and gradients ({_s(resident['params'] + resident['grads'])}) exceed the "
                f"{_s(usable)} usable even with the {name} state offloaded")
    else:
        what = (f"Even the smallest plan ({words(smallest)}) reserves {_s(_reserved(smallest))} of "
                f"the {_s(usable)} usable, {_s(smallest.estimate.breakdown.get('activations', 0))} of it "
                f"activations")
    # Options combined (LoRA on bf16 weights) may fit where none alone does: say only what was worked out.
    alone = "; by this breakdown no one change of --optimizer, --trainable or --weights fits"
    return f"{what}: no plan fits{_options(result, smallest, 'fit', fallback=alone)}."


def _fewer_activations(batch: dict) -> str:
    """What shrinks the activations, by the batch's kind: shorter rows only where --seq-len sets
    their length (tokens), fewer rows always."""
    if batch["row_length"] == "seq_len":
        return "a shorter --seq-len or a smaller --batch-size would let a faster plan fit"
    if batch["row_length"] == "config":
        return (f"a smaller --batch-size would let a faster plan fit (the model's config, not --seq-len, "
                f"sizes each row's main input: {batch['row']})")
    return "a smaller --batch-size would let a faster plan fit"


def _options(result: dict, candidate, outcome: str, fallback: str = "") -> str:
    """'; by this breakdown, --optimizer sgd or --trainable lora would {outcome}' (or `fallback`)."""
    found = [_with_package(option) for option in fitting_options(result, candidate)]
    if not found:
        return fallback
    listed = found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"
    return f"; by this breakdown, {listed} would {outcome}"


def fitting_options(result: dict, candidate) -> list[str]:
    """The options whose saving brings `candidate`'s reserved peak, with the optimizer state on the
    device, within the usable bytes (see the module docstring)."""
    usable = result["usable_bytes"]
    resident = _resident(candidate)
    state = resident["optimizer"]
    on_device = _reserved(candidate) + (state if candidate.plan.offload_optimizer else 0)
    found = []
    current = STATE_BYTES.get(result["optimizer"])
    trained = result["trained_parameters"]
    scale = 0.5 if result["weights"] == "bf16" else 1.0  # bf16 weights keep bf16 state
    for option, per_parameter in STATE_BYTES.items():
        if current is not None and per_parameter < current:
            if on_device - state + trained * per_parameter * scale <= usable:
                found.append(f"--optimizer {option}")
                break
    # LoRA checkpoints as the full model does (the wrapped model's switch), keeping about the same
    # activations (a 6-layer Llama, bf16 weights, 8 x 256, one row: 3.26 MiB with LoRA, 3.32 MiB
    # full); without checkpointing it keeps more, its adapters' inputs (9.53 against 7.61 MiB).
    if result["trainable"] == "full" and on_device - resident["grads"] - state <= usable:
        found.append("--trainable lora")
    if result["weights"] == "fp32" and on_device - (resident["params"] + resident["grads"] + state) / 2 <= usable:
        found.append("--weights bf16")
    return found


def _with_package(option: str) -> str:
    """An option as the user can run it: '--trainable lora (with peft installed)' where it needs a
    package that is not installed (the probe itself refuses the option without it)."""
    package = NEEDS.get(tuple(option.split(" ", 1)))
    return option if package is None or installed(package) else f"{option} (with {package} installed)"


def _resident(candidate) -> dict:
    resident = candidate.estimate.resident
    return {k: int(resident.get(k, 0)) for k in ("params", "grads", "optimizer")}


def _model_states(candidate, *, with_state: bool) -> int:
    resident = _resident(candidate)
    return resident["params"] + resident["grads"] + (resident["optimizer"] if with_state else 0)


def _reserved(candidate) -> int:
    return int(candidate.estimate.peak("reserved"))


def _largest(estimate) -> tuple[str, int]:
    """The largest part of `estimate`'s peak the job decides (the card's own workspaces, counted in
    "other", are left out of it: no option changes them)."""
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
             "activations": "activations", "other": "the rest"}
    breakdown = dict(estimate.breakdown)
    breakdown["other"] = breakdown.get("other", 0) - getattr(estimate, "workspace_bytes", 0)
    kind = max(breakdown, key=lambda k: breakdown[k])
    return names.get(kind, kind), int(breakdown[kind])


def _s(n) -> str:
    return format_size(int(n))
