"""`autofit probe`: which plans fit a card of a given size, predicted on fake tensors."""

from __future__ import annotations

import json
import sys

from autofit.sizes import format_size
from autofit.commands import finetune, verdict
from autofit.commands import EXIT_DOES_NOT_FIT, EXIT_OK, UsageError, attempts_table, out, positive_arg, size_arg
from autofit.errors import NoLossError, chain, one_line

# Without CUDA to measure it: the context (kernels, cuBLAS/cuDNN handles) takes ~0.3-0.45 GiB
# outside any allocator budget.
DEFAULT_CONTEXT_RESERVE = 2**30 * 2 // 5  # 0.4 GiB
VERIFY_STEPS = 3


def context_reserve(override: str | None) -> tuple[int, str]:
    """(bytes the CUDA context takes, where the number comes from)."""
    if override is not None:
        return size_arg("--context-reserve", override, allow_zero=True), "given"
    import torch
    if torch.cuda.is_available():
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        return total - free, "measured: total - free after CUDA initialised, nothing allocated"
    return DEFAULT_CONTEXT_RESERVE, "assumed: no CUDA here to measure it"


def _plan_row(candidate, chosen, weights: str) -> dict:
    plan = candidate.plan
    return {**plan.to_dict(), "compute_dtype": finetune.compute_dtype(plan.precision, weights),
            "peak_bytes": int(candidate.estimate.peak_bytes),
            "reserved_bytes": int(candidate.estimate.peak("reserved")),
            "fits": bool(candidate.fits), "cost": candidate.cost, "chosen": candidate is chosen}


def cmd_probe(args) -> int:
    gpu_mem = _checked_usage(args)
    reserve, reserve_source = context_reserve(args.context_reserve)
    optimizer = finetune.optimizer_factory(args.optimizer)  # a missing package is bad usage, before any work
    from autofit.commands import models, quantized, samples
    from autofit.estimator.estimate import own_reserved
    from autofit.gpu.workspaces import Workspaces
    model, batch = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len)
    attention = models.set_attention(model, args.attn)
    described = samples.describe(batch, model)
    with models.quiet_transformers():
        model = finetune.prepare(model, trainable=args.trainable, lora_rank=args.lora_rank,
                                 weights=args.weights)
    batch = finetune.batch_for(batch, weights=args.weights)
    # The card is not at hand: its libraries' workspaces are a current card's (the larger ones).
    workspaces = Workspaces.of_capability()
    kept = workspaces.reserve(model)  # cuDNN's, for a model with convolutions
    own = own_reserved(workspaces)
    spec = args.model or models.DEFAULT
    budget = gpu_mem - reserve
    header = {"model": spec, "model_class": type(model).__name__,
              "parameters": quantized.parameter_count(model),
              "trainable": args.trainable, "trained_parameters": finetune.trained_parameters(model),
              "optimizer": args.optimizer, "weights": args.weights, "attention": attention,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "batch": described,
              "missing_kernels": models.missing_kernels(model),
              "precision": args.precision,
              "gpu_mem_bytes": gpu_mem, "context_reserve_bytes": reserve,
              "context_reserve_source": reserve_source, "budget_bytes": max(budget, 0),
              "workspace_bytes": own, "workspace_reserve_bytes": kept,
              "usable_bytes": max(budget - kept, 0)}
    no_room = _no_room(gpu_mem, reserve, budget, own + kept)
    if no_room is not None:
        return _probe_report(args, _no_plan(header, no_room), None)

    from autofit.estimator import capacity
    try:
        with models.quiet_transformers():  # "use_cache=True is incompatible with checkpointing"...
            # A card's limit caps what the caching allocator reserves: the reserved peak decides.
            estimator = capacity.make_estimator(model, batch, optimizer, device_type="cuda",
                                                workspaces=workspaces)
            candidates = capacity.rank(estimator, batch, budget,
                                       fit=capacity.Fit(caps="reserved", reserve=kept, workspaces=workspaces),
                                       space=capacity.Space(args.precision))
    except Exception as e:  # the model cannot take its batch, or the estimator cannot follow it
        reason = _why_not_estimated(e, args, spec, model, batch, described, optimizer)
        return _cannot_estimate(args, _no_plan(header, reason))
    result, shown = _result(header, candidates, budget, kept, args.weights)
    code = _probe_report(args, result, shown)
    if code == EXIT_OK and args.verify:
        code = _verify(args, budget, shown)  # a plan fits: the one shown is the one chosen
    return code


def _checked_usage(args) -> int:
    """The card's memory in bytes, once every option is checked (UsageError: bad usage, exit 2)."""
    gpu_mem = size_arg("--gpu-mem", args.gpu_mem)
    positive_arg("--batch-size", args.batch_size)
    positive_arg("--seq-len", args.seq_len)
    positive_arg("--lora-rank", args.lora_rank)
    import torch
    if args.verify and not torch.cuda.is_available():
        raise UsageError("--verify trains real steps on a CUDA device and this machine has none; "
                         "drop --verify to get the prediction alone.")
    if args.verify and args.weights in finetune.QUANTIZED:
        raise UsageError(f"--verify trains real steps, and --weights {args.weights} is priced without "
                         f"bitsandbytes' kernels; drop --verify to get the prediction alone.")
    return gpu_mem


def _no_room(gpu_mem: int, reserve: int, budget: int, own: int) -> str | None:
    """Why nothing is left for tensors (the context reserve, then the libraries' `own` bytes take
    the card), or None."""
    if budget <= 0:
        return (f"the card's {format_size(gpu_mem)} is all taken by the CUDA context reserve "
                f"({format_size(reserve)}); nothing is left for tensors.")
    if budget <= own:
        return (f"the card's {format_size(gpu_mem)} less the CUDA context reserve "
                f"({format_size(reserve)}) leaves {format_size(budget)}, not more than the "
                f"{format_size(own)} of cuBLAS/cuDNN workspaces; nothing is left "
                f"for tensors.")
    return None


def _why_not_estimated(error, args, spec, model, batch, described, optimizer) -> str:
    """The reason the probe gives when the model's step could not be estimated; UsageError where
    the model computes no loss (nothing to price: bad usage)."""
    from autofit.commands import models
    if _caused_by(error, NoLossError) and models.is_function_spec(spec):
        raise UsageError(
            f"{type(model).__name__} computes no loss from the batch {spec} returned "
            f"({models.describe(model, batch)}), so there is no training step to price: return a "
            f"batch with the labels it takes, or a model whose forward returns its loss.") from None
    if _caused_by(error, NoLossError):
        raise UsageError(
            f"{type(model).__name__} computes no loss from the probe's labels, so there is no training "
            f"step to price: name a class with a task head that trains in the config's architectures "
            f"(e.g. a *ForSequenceClassification, *ForCausalLM, *ForImageClassification), or give "
            f"module:function returning a model whose forward returns its loss.") from None
    reason = (f"cannot estimate this model: a training step of {spec} on its sample batch "
              f"({models.describe(model, batch)}) failed: {one_line(error)}")
    longer = _longer_rows(args, optimizer) if described["row_length"] == "seq_len" else None
    if longer is not None:  # a model may refuse rows too short for it (wav2vec2's convolutions)
        reason = reason.rstrip(".") + (f". With --seq-len {longer} it is estimated ({longer // LONGER} "
                                       f"failed too): pass a larger --seq-len.")
    return reason


def _result(header: dict, candidates, budget: int, kept: int, weights: str) -> tuple[dict, object]:
    """(the probe's result, the candidate it shows: the chosen plan, else the leanest estimated)."""
    from autofit.estimator import capacity
    chosen = capacity.choose(candidates)
    shown = chosen if chosen is not None else capacity.leanest(candidates, "reserved")
    reason = None if chosen is not None else capacity.needs_message(
        candidates, budget, caps="reserved", reserve=kept)
    result = {**header, "fits": chosen is not None,
              "plan": None if chosen is None else chosen.plan.to_dict(),
              "compute_dtype": None if chosen is None else finetune.compute_dtype(chosen.plan.precision,
                                                                                 weights),
              "predicted_peak_bytes": None if shown is None else int(shown.estimate.peak_bytes),
              "predicted_reserved_bytes": None if shown is None else int(shown.estimate.peak("reserved")),
              "table": [_plan_row(c, chosen, weights) for c in candidates],
              "breakdown": None if shown is None else {k: int(v) for k, v in
                                                      shown.estimate.breakdown.items()},
              "host_optimizer_bytes": _host_state(shown),
              "reason": reason}
    result["verdict"] = verdict.sentence(result, candidates, chosen)
    return result, shown


def _caused_by(error: BaseException, kind: type) -> bool:
    return any(isinstance(link, kind) for link in chain(error))


LONGER = 4  # how much longer each row the hint tries
LONGEST = 65536


def _longer_rows(args, optimizer) -> int | None:
    """The first --seq-len (x4 at a time, up to the model's positions) whose step (the batch
    as given, fp32, one micro-batch) the estimator follows, where the given one failed: the hint
    that the rows were too short is then a fact, not a guess; None when no longer row helps (the
    failure is something else)."""
    import torch
    from autofit.commands import models
    from autofit.estimator.estimate import estimate
    from autofit.plans.plan import Plan
    length = args.seq_len * LONGER
    while length <= LONGEST:
        try:
            with models.quiet_transformers():
                model, batch = models.load(args.model, batch_size=args.batch_size, seq_len=length)
                models.set_attention(model, args.attn)
                config = getattr(model, "config", None)
                limit = getattr(config, "max_position_embeddings", None)
                if isinstance(limit, int) and length > limit:
                    return None
                model = finetune.prepare(model, trainable=args.trainable, lora_rank=args.lora_rank,
                                         weights=args.weights)
                estimate(model, finetune.batch_for(batch, weights=args.weights),
                         Plan(args.batch_size, precision="fp32"), optimizer=optimizer,
                         device_type="cuda" if torch.cuda.is_available() else "cpu")
            return length
        except Exception:  # this length fails too: a longer one may not
            length *= LONGER
    return None


_TRAINED = {"full": "the whole model", "frozen-base": "the head on a frozen base", "lora": "LoRA adapters"}
_OPTIMIZER_NAMES = finetune.OPTIMIZER_NAMES


def _no_plan(header: dict, reason: str) -> dict:
    """The probe's result when nothing was estimated: every field of a result, empty."""
    return {**header, "fits": False, "plan": None, "compute_dtype": None, "predicted_peak_bytes": None,
            "predicted_reserved_bytes": None, "table": [], "breakdown": None,
            "host_optimizer_bytes": None, "reason": reason, "verdict": None}


def _host_state(shown) -> int | None:
    """Bytes of optimizer state an offloaded plan keeps in host memory (its step runs there, so the
    device breakdown shows none of it); None for a plan that keeps the state on the device."""
    if shown is None or not shown.plan.offload_optimizer:
        return None
    return int(shown.estimate.resident.get("optimizer", 0))


def _cannot_estimate(args, result: dict) -> int:
    """No prediction: the reason on stderr (and the header as JSON); exit 1, as for no fit."""
    if args.json:
        out(json.dumps(result, indent=2))
    print(f"autofit: {result['reason']}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def _probe_report(args, result: dict, shown) -> int:
    code = EXIT_OK if result["fits"] else EXIT_DOES_NOT_FIT
    if args.json:
        out(json.dumps(result, indent=2))
        if result["reason"]:
            print(f"autofit: does not fit: {result['reason']}", file=sys.stderr)
        return code
    from autofit.sizes import format_breakdown
    from autofit.diagnosis.report import key_values, table
    out(key_values([
        ("model", f"{result['model']} ({result['model_class']}, "
                  f"{result['parameters'] / 1e6:.2f}M parameters)"),
        ("fine-tune", f"{_TRAINED[result['trainable']]}, {_OPTIMIZER_NAMES[result['optimizer']]}, "
                      f"{result['weights']} weights ({result['trained_parameters'] / 1e6:.2f}M trained "
                      f"parameters)"),
        ("global batch", result["batch"]["text"]),
        *([("attention", result["attention"])] if result["attention"] else []),
        *_fallback(result),
        ("gpu memory", format_size(result["gpu_mem_bytes"])),
        ("context reserve", f"{format_size(result['context_reserve_bytes'])} "
                            f"({result['context_reserve_source']})"),
        ("budget", f"{format_size(result['budget_bytes'])} for tensors; a plan fits when its reserved "
                   f"peak ({format_size(result['workspace_bytes'])} of cuBLAS workspaces included) is "
                   f"within {format_size(result['usable_bytes'])}{_kept(result)}"),
    ]))
    if result["table"]:
        out()
        out("plans estimated, fastest first (* chosen; time relative to one fp32 pass over the "
             "whole batch):")
        rows = [["*" if r["chosen"] else "", r["micro_batch_size"], r["accumulation_steps"],
                 finetune.precision_text(r["precision"], result["weights"]), r["checkpointing"],
                 r["offload_optimizer"], f"{r['cost']:.2f}",
                 format_size(r["peak_bytes"]), format_size(r["reserved_bytes"]), r["fits"]]
                for r in result["table"]]
        # The plan's fields this table shows, named as its columns are (not the registry's words).
        out(table(["", "micro", "accum", "precision", "checkpointing", "offload", "time",
                   "allocated peak", "reserved peak", "fits"], rows, align="lrrlllrrrl"))
    out()
    if shown is not None:
        described = finetune.plan_text(shown.plan, result["weights"])
        out(f"chosen plan: {described}" if result["fits"] else "no plan fits")
        if not result["fits"]:
            out(f"smallest plan: {described}")
        out(f"predicted peak: {format_breakdown(shown.estimate.breakdown, result['budget_bytes'])}")
        if result["host_optimizer_bytes"] is not None:
            out(f"offloaded: {format_size(result['host_optimizer_bytes'])} of optimizer state in host "
                f"memory, where the optimizer steps (none of it on the device)")
        reserved = result["predicted_reserved_bytes"]
        out(f"predicted reserved peak: {format_size(reserved)} of {format_size(result['usable_bytes'])} "
            f"usable ({format_size(reserved - result['predicted_peak_bytes'])} of segments and cached "
            f"blocks above the allocated peak)")
    else:
        out("no plan fits")
    if result["verdict"]:
        out(result["verdict"])
    if not result["fits"]:
        print(f"autofit: does not fit: {result['reason']}", file=sys.stderr)
    return code


def _fallback(result) -> list[tuple[str, str]]:
    """The line saying the price is of transformers' torch fallback, where kernels are missing."""
    missing = result["missing_kernels"]
    if not missing:
        return []
    return [("slow path", f"priced on transformers' torch fallback: {', '.join(missing)} not installed "
                          f"(with its kernels a step holds less)")]


def _kept(result) -> str:
    kept = result["workspace_reserve_bytes"]
    return f", {format_size(kept)} kept for cuDNN's convolution workspaces" if kept else ""


def _verify(args, budget: int, chosen) -> int:
    """Train a few real steps on CUDA under the budget; compare the measured peak with the prediction."""
    from autofit.commands import models
    from autofit import run
    from autofit.errors import DoesNotFit
    model, batch = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                               device="cpu")
    models.set_attention(model, args.attn)  # the attention the prediction priced
    with models.quiet_transformers():  # the fine-tune the prediction priced, on the real model
        model = finetune.prepare(model, trainable=args.trainable, lora_rank=args.lora_rank,
                                 weights=args.weights)
    batch = finetune.batch_for(batch, weights=args.weights)
    out()
    out(f"verifying: {VERIFY_STEPS} real steps on CUDA under a {format_size(budget)} budget")
    try:
        with models.quiet_transformers():
            result = run(model, [batch] * VERIFY_STEPS, budget=budget, precision=args.precision,
                         optimizer=finetune.optimizer_factory(args.optimizer), progress=False, cache=False)
    except DoesNotFit as e:
        attempts_table(e.attempts)
        print(f"autofit: does not fit: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    attempts_table(result.attempts)
    peak = max((a.peak_bytes for a in result.attempts if a.outcome == "ok"), default=0)
    ran, predicted = (finetune.plan_text(p, args.weights) for p in (result.plan, chosen.plan))
    out(f"verified plan: {ran}, measured peak {format_size(peak)} "
        f"(predicted {format_size(chosen.estimate.peak_bytes)} for {predicted})")
    return EXIT_OK
