"""autofit's command line: `autofit probe`, `autofit demo`, `autofit cache`.

`main(argv) -> int` does everything and returns the exit status; `entry()` is the console script.
Exit status: 0 done (probe: some plan fits), 1 does not fit (probe, demo) or nothing found (cache
show), 2 bad usage (a one-line "autofit: error: ..." on stderr, a traceback only with --debug),
3 an unexpected internal error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import traceback

from .sizes import format_size, parse_size

EXIT_OK = 0
EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

DEFAULT_CONTEXT_RESERVE = 2**30 * 2 // 5  # 0.4 GiB
CONTEXT_RESERVE_REASON = (
    "the CUDA context (kernels, cuBLAS/cuDNN handles) takes ~0.3-0.45 GiB outside any allocator "
    "budget; without CUDA here it cannot be measured, so 0.4 GiB is assumed")

DEMO_MODEL = "tiny-bert"
DEMO_BUDGET = "8MiB"
DEMO_BATCH, DEMO_SEQ, DEMO_STEPS = 64, 64, 4

VERIFY_STEPS = 3
MARGIN = 0.9  # plans must fit this share of the budget: CUDA's allocator fragments (DESIGN: 3-40%)

log = logging.getLogger("autofit")


class UsageError(Exception):
    """Bad usage: printed as one "autofit: error:" line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- the parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .models import DEFAULT, known

    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    parser = _Parser(
        prog="autofit", parents=[debug],
        description="Make a PyTorch training job fit its GPU: predict which plan fits a card "
                    "(probe), watch the out-of-memory ladder work (demo), inspect cached plans (cache).",
        epilog="Exit status: 0 ok, 1 does not fit / not found, 2 bad usage, 3 internal error.")
    parser.add_argument("--version", action="version", version=f"autofit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    probe = commands.add_parser(
        "probe", parents=[debug], help="predict which plans fit a GPU of a given size, without one",
        description="Rank the plans (micro-batch x accumulation, precision, checkpointing, offload) "
                    "for one training step of a model by predicted peak memory on a CUDA card of "
                    "--gpu-mem total memory, and choose the fastest that fits. The estimate runs on "
                    "fake tensors: no GPU and no real memory needed.",
        epilog=f"Models: {known()} (default {DEFAULT}, from transformers' default config, random "
               f"weights, nothing downloaded); a path to a transformers config.json or its directory; "
               f"or module:function returning (model, sample_batch), called with the batch_size and "
               f"seq_len it accepts. Exit status: 0 some plan fits, 1 none does, 2 bad usage.")
    probe.add_argument("--gpu-mem", required=True, metavar="SIZE",
                       help="the card's total memory, e.g. 2GiB, 16GB, 80GiB")
    probe.add_argument("--model", metavar="SPEC", default=None, help=f"the model (default {DEFAULT})")
    probe.add_argument("--batch-size", type=int, default=32, metavar="N",
                       help="global batch: samples per optimizer step (default 32)")
    probe.add_argument("--seq-len", type=int, default=128, metavar="N",
                       help="tokens per sample (default 128)")
    probe.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                       help="auto: may choose bf16 autocast; otherwise only that precision (default auto)")
    probe.add_argument("--context-reserve", metavar="SIZE", default=None,
                       help="the CUDA context's memory to subtract (default: measured when CUDA is "
                            "present, else 0.4 GiB)")
    probe.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    probe.add_argument("--verify", action="store_true",
                       help=f"also train {VERIFY_STEPS} real steps under the budget (needs CUDA)")
    probe.set_defaults(func=cmd_probe)

    demo = commands.add_parser(
        "demo", parents=[debug], help="train a tiny model on a simulated GPU that runs out of memory",
        description="Train a tiny BERT (random weights, synthetic data) on a simulated GPU small "
                    "enough to run out of memory, and show every attempt: the out-of-memory errors "
                    "caught, the plans stepped down to, and the plan training finished with.")
    demo.add_argument("--budget", default=DEMO_BUDGET, metavar="SIZE",
                      help=f"the simulated GPU's memory (default {DEMO_BUDGET})")
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, metavar="N",
                      help=f"optimizer steps, each one global batch of {DEMO_BATCH} (default {DEMO_STEPS})")
    demo.set_defaults(func=cmd_demo)

    cache = commands.add_parser(
        "cache", parents=[debug], help="list, show or clear the plans that worked",
        description="The plan cache: plans that worked, per model, batch and device. Its file is "
                    "$AUTOFIT_CACHE_DIR/plans.sqlite, else plans.sqlite in the user cache directory.")
    actions = cache.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", parents=[debug], help="one line per cached plan, newest first")
    listing.set_defaults(func=cmd_cache_list)
    show = actions.add_parser("show", parents=[debug], help="one cached plan as JSON")
    show.add_argument("key", metavar="KEY", help="a key, or a unique prefix of one (as `list` prints)")
    show.set_defaults(func=cmd_cache_show)
    clear = actions.add_parser("clear", parents=[debug], help="remove every cached plan")
    clear.set_defaults(func=cmd_cache_clear)
    cache.set_defaults(func=lambda args: _missing_command(cache))
    parser.set_defaults(func=lambda args: _missing_command(parser))
    return parser


def _missing_command(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


# -- main -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with _log_to_stderr():
        try:
            args = build_parser().parse_args(argv)
        except UsageError as e:
            return _fail(e, EXIT_USAGE, debug=False)
        except SystemExit as e:  # --help, --version
            return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
        debug = getattr(args, "debug", False)
        from .models import ModelSpecError
        try:
            return args.func(args)
        except (UsageError, ModelSpecError) as e:
            return _fail(e, EXIT_USAGE, debug)
        except KeyboardInterrupt:
            print("autofit: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:
            return _fail(f"unexpected {_one_line(e)}" + ("" if debug else "; rerun with --debug for "
                                                         "the traceback"), EXIT_INTERNAL, debug)


def entry() -> None:
    """The `autofit` console script."""
    sys.exit(main())


def _fail(error, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"autofit: error: {error}", file=sys.stderr)
    return code


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class _LowerLevel(logging.Formatter):
    def format(self, record):
        record = logging.makeLogRecord({**record.__dict__, "levelname": record.levelname.lower()})
        return super().format(record)


@contextlib.contextmanager
def _log_to_stderr():
    """autofit's warnings (a corrupt cache, a step-down) as "autofit: warning:" lines while main runs."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LowerLevel("autofit: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _size(option: str, text: str, allow_zero: bool = False) -> int:
    if allow_zero and text.strip() in ("0", "0B", "0b"):
        return 0
    try:
        return parse_size(text)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{option} {text!r}: {e}") from None


def _positive(option: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{option} must be a positive integer but got {value}.")
    return value


def _out(text: str = "") -> None:
    print(text, file=sys.stdout)


# -- probe ----------------------------------------------------------------------------------------

def context_reserve(override: str | None) -> tuple[int, str]:
    """(bytes the CUDA context takes, where the number comes from)."""
    if override is not None:
        return _size("--context-reserve", override, allow_zero=True), "given"
    import torch
    if torch.cuda.is_available():
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        return total - free, "measured: total - free after CUDA initialised, nothing allocated"
    return DEFAULT_CONTEXT_RESERVE, "assumed: no CUDA here to measure it"


def _plan_row(candidate, chosen) -> dict:
    plan = candidate.plan
    return {**plan.to_dict(), "peak_bytes": int(candidate.estimate.peak_bytes),
            "fits": bool(candidate.fits), "cost": candidate.cost, "chosen": candidate is chosen}


def cmd_probe(args) -> int:
    gpu_mem = _size("--gpu-mem", args.gpu_mem)
    _positive("--batch-size", args.batch_size)
    _positive("--seq-len", args.seq_len)
    import torch
    if args.verify and not torch.cuda.is_available():
        raise UsageError("--verify trains real steps on a CUDA device and this machine has none; "
                         "drop --verify to get the prediction alone.")
    reserve, reserve_source = context_reserve(args.context_reserve)
    from . import models
    model, batch = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len)
    spec = args.model or models.DEFAULT
    budget = gpu_mem - reserve
    header = {"model": spec, "model_class": type(model).__name__,
              "parameters": sum(p.numel() for p in model.parameters()),
              "batch_size": args.batch_size, "seq_len": args.seq_len, "precision": args.precision,
              "gpu_mem_bytes": gpu_mem, "context_reserve_bytes": reserve,
              "context_reserve_source": reserve_source, "budget_bytes": max(budget, 0),
              "margin": MARGIN, "usable_bytes": max(int(budget * MARGIN), 0)}
    if budget <= 0:
        reason = (f"the card's {format_size(gpu_mem)} is all taken by the CUDA context reserve "
                  f"({format_size(reserve)}); nothing is left for tensors.")
        result = {**header, "fits": False, "plan": None, "predicted_peak_bytes": None,
                  "table": [], "breakdown": None, "reason": reason}
        return _probe_report(args, result, None)

    from . import capacity
    try:
        with models.quiet_transformers():  # "use_cache=True is incompatible with checkpointing"...
            candidates = capacity.rank(model, batch, budget, precision=args.precision, margin=MARGIN,
                                       device_type="cuda")
    except Exception as e:  # the model cannot take its batch (or the estimator cannot follow it)
        raise UsageError(f"estimating a training step of {spec} on its sample batch "
                         f"({models.describe(model, batch)}) failed: {_one_line(e)}") from e
    chosen = capacity.choose(candidates)
    shown = chosen if chosen is not None else min(candidates, key=lambda c: c.estimate.peak_bytes,
                                                  default=None)
    reason = None if chosen is not None else capacity.needs_message(candidates, budget, margin=MARGIN)
    result = {**header, "fits": chosen is not None,
              "plan": None if chosen is None else chosen.plan.to_dict(),
              "predicted_peak_bytes": None if shown is None else int(shown.estimate.peak_bytes),
              "table": [_plan_row(c, chosen) for c in candidates],
              "breakdown": None if shown is None else {k: int(v) for k, v in
                                                      shown.estimate.breakdown.items()},
              "reason": reason}
    code = _probe_report(args, result, shown)
    if code == EXIT_OK and args.verify:
        code = _verify(args, budget, chosen)
    return code


def _probe_report(args, result: dict, shown) -> int:
    code = EXIT_OK if result["fits"] else EXIT_DOES_NOT_FIT
    if args.json:
        _out(json.dumps(result, indent=2))
        if result["reason"]:
            print(f"autofit: does not fit: {result['reason']}", file=sys.stderr)
        return code
    from .memory import format_breakdown
    from .report import key_values, table
    _out(key_values([
        ("model", f"{result['model']} ({result['model_class']}, "
                  f"{result['parameters'] / 1e6:.2f}M parameters)"),
        ("global batch", f"{result['batch_size']} x {result['seq_len']} tokens"),
        ("gpu memory", format_size(result["gpu_mem_bytes"])),
        ("context reserve", f"{format_size(result['context_reserve_bytes'])} "
                            f"({result['context_reserve_source']})"),
        ("budget", f"{format_size(result['budget_bytes'])} for tensors; a plan fits in "
                   f"{result['margin']:.0%} of it ({format_size(result['usable_bytes'])}), the rest "
                   f"is left to allocator fragmentation"),
    ]))
    if result["table"]:
        _out()
        _out("plans estimated, fastest first (* chosen; time relative to one fp32 pass over the "
             "whole batch):")
        rows = [["*" if r["chosen"] else "", r["micro_batch_size"], r["accumulation_steps"],
                 r["precision"], r["checkpointing"], r["offload_optimizer"], f"{r['cost']:.2f}",
                 format_size(r["peak_bytes"]), r["fits"]] for r in result["table"]]
        _out(table(["", "micro", "accum", "precision", "checkpointing", "offload", "time",
                    "predicted peak", "fits"], rows, align="lrrlllrrl"))
    _out()
    if shown is not None and result["fits"]:
        _out(f"chosen plan: {shown.plan.describe()}")
        _out(f"predicted peak: {format_breakdown(shown.estimate.breakdown, result['budget_bytes'])}")
    else:
        _out("no plan fits")
        if shown is not None:
            _out(f"smallest plan: {shown.plan.describe()}")
            _out(f"predicted peak: {format_breakdown(shown.estimate.breakdown, result['budget_bytes'])}")
        print(f"autofit: does not fit: {result['reason']}", file=sys.stderr)
    return code


def _verify(args, budget: int, chosen) -> int:
    """Train a few real steps on CUDA under the budget; compare the measured peak with the prediction."""
    from . import models, run
    from .errors import DoesNotFit
    model, batch = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                               device="cpu")
    _out()
    _out(f"verifying: {VERIFY_STEPS} real steps on CUDA under a {format_size(budget)} budget")
    try:
        with models.quiet_transformers():
            result = run(model, [batch] * VERIFY_STEPS, budget=budget, precision=args.precision,
                         progress=False, cache=False)
    except DoesNotFit as e:
        _attempts_table(e.attempts)
        print(f"autofit: does not fit: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    _attempts_table(result.attempts)
    peak = max((a.peak_bytes for a in result.attempts if a.outcome == "ok"), default=0)
    _out(f"verified plan: {result.plan.describe()}, measured peak {format_size(peak)} "
         f"(predicted {format_size(chosen.estimate.peak_bytes)} for {chosen.plan.describe()})")
    return EXIT_OK


def _attempts_table(attempts) -> None:
    from .report import table
    rows = [[a.step, a.plan.describe(), a.outcome, format_size(a.peak_bytes) if a.peak_bytes else None,
             a.reason] for a in attempts]
    _out(table(["step", "plan", "outcome", "peak", "reason"], rows, align="rllrl"))


# -- demo -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _one_thread():
    """A tiny model's ops are too small for intra-op threads; on a busy machine OpenMP's spinning
    threads made the demo ~8x slower. Restored afterwards (main() runs inside tests too)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cmd_demo(args) -> int:
    budget = _size("--budget", args.budget)
    steps = _positive("--steps", args.steps)
    import torch

    from . import models, run, simulate_gpu
    from .errors import DoesNotFit
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, batch = models.load(DEMO_MODEL, batch_size=DEMO_BATCH, seq_len=DEMO_SEQ, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    _out(f"model: {DEMO_MODEL} ({type(model).__name__}, {n_params / 1e6:.2f}M parameters, random "
         f"weights), global batch {DEMO_BATCH} x {DEMO_SEQ} tokens, {steps} step(s)")
    _out(f"simulated GPU: {format_size(budget)} (CPU tensors counted as a CUDA allocator would; going "
         f"over raises torch.OutOfMemoryError)")
    _out("capacity check off: every plan below is found by running out of memory and stepping down")
    _out()
    with _one_thread():
        try:
            with simulate_gpu(budget), models.quiet_transformers():
                # The capacity check would start at a fitting plan; the demo shows the retry ladder.
                result = run(model, [batch] * steps, progress=False, cache=False, capacity_check=False)
        except DoesNotFit as e:
            _attempts_table(e.attempts)
            _out()
            print(f"autofit: does not fit: {str(e).splitlines()[0]}", file=sys.stderr)
            if e.breakdown:
                from .memory import format_breakdown
                print(f"autofit: memory at the last failure: {format_breakdown(e.breakdown, budget)}",
                      file=sys.stderr)
            return EXIT_DOES_NOT_FIT
    _attempts_table(result.attempts)
    _out()
    ooms = result.oom_attempts
    losses = [h["loss"] for h in result.history]
    _out(f"final plan: {result.plan.describe()} (global batch {DEMO_BATCH} unchanged)")
    _out(f"{ooms} out-of-memory attempt(s) caught and replayed; {len(losses)} step(s) trained, loss "
         f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    return EXIT_OK


# -- cache ----------------------------------------------------------------------------------------

def _cache():
    from .cache import PlanCache
    return PlanCache()


def _short_class(fields: dict) -> str:
    model = fields.get("model")
    name = model.get("class") if isinstance(model, dict) else None
    return name.rsplit(".", 1)[-1] if isinstance(name, str) else None


def _device_name(fields: dict) -> str | None:
    device = fields.get("device")
    return device.get("name") if isinstance(device, dict) else None


def cmd_cache_list(args) -> int:
    from .plan import Plan
    from .report import table
    cache = _cache()
    entries = cache.entries()
    _out(f"plan cache: {cache.path}")
    if not entries:
        _out("no cached plans")
        return EXIT_OK
    rows = []
    for e in entries:
        fields, entry = e["fields"], e["entry"]
        rows.append([e["key"][:12], _short_class(fields), fields.get("global_batch"), _device_name(fields),
                     Plan.from_dict(entry["plan"]).describe(), format_size(entry["peak_bytes"]),
                     entry["when"][:19].replace("T", " ")])
    _out(table(["key", "model", "global batch", "device", "plan", "peak", "when (UTC)"], rows))
    return EXIT_OK


def cmd_cache_show(args) -> int:
    cache = _cache()
    matches = [e for e in cache.entries() if e["key"].startswith(args.key)]
    if not matches:
        print(f"autofit: error: no cached plan has a key starting with {args.key!r} in {cache.path}; "
              f"`autofit cache list` shows the keys.", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    exact = [e for e in matches if e["key"] == args.key]
    if len(matches) > 1 and not exact:
        raise UsageError(f"{len(matches)} cached plans have a key starting with {args.key!r}; give "
                         f"more of the key.")
    _out(json.dumps((exact or matches)[0], indent=2, sort_keys=True))
    return EXIT_OK


def cmd_cache_clear(args) -> int:
    cache = _cache()
    removed = cache.clear()
    _out(f"removed {removed} cached plan(s) from {cache.path}")
    return EXIT_OK


if __name__ == "__main__":
    entry()
