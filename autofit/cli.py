"""autofit's command line: `autofit probe`, `autofit demo`, `autofit cache`.

`main(argv) -> int` does everything and returns the exit status; `entry()` is the console script.
Exit status: 0 done (probe: some plan fits), 1 does not fit (probe, demo) or nothing found (cache
show), 2 bad usage (a one-line "autofit: error: ..." on stderr, a traceback only with --debug),
3 an unexpected internal error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import traceback

from autofit.commands import finetune
from autofit.commands import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from autofit.errors import one_line
from autofit.commands.cache import cmd_cache_clear, cmd_cache_list, cmd_cache_show
from autofit.commands.demo import DEMO_BATCH, DEMO_BUDGET, DEMO_STEPS, cmd_demo
from autofit.commands.probe import VERIFY_STEPS, cmd_probe
from autofit.plans import precision as precisions

log = logging.getLogger("autofit")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- the parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each command's arguments are added by its own function."""
    from autofit import __version__

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
    for add in (_add_probe, _add_demo, _add_cache):
        add(commands, debug)
    parser.set_defaults(func=lambda args: _missing_command(parser))
    return parser


def _add_probe(commands, debug) -> None:
    from autofit.commands.models import DEFAULT, known

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
    probe.add_argument("--precision", choices=precisions.policies(), default=precisions.AUTO,
                       help="auto: may choose bf16 autocast; otherwise only that precision (default auto)")
    probe.add_argument("--optimizer", choices=finetune.OPTIMIZERS, default="adamw",
                       help="the optimizer whose state is priced (default adamw)")
    probe.add_argument("--trainable", choices=finetune.TRAINABLE, default="full",
                       help="what is trained: the whole model, the task head on a frozen base, or "
                            "LoRA adapters (needs peft) (default full)")
    probe.add_argument("--lora-rank", type=int, default=16, metavar="R",
                       help="the LoRA rank with --trainable lora (default 16)")
    probe.add_argument("--weights", choices=finetune.WEIGHTS, default="fp32",
                       help="the dtype of the model's weights (default fp32)")
    probe.add_argument("--attn", metavar="NAME", default=None,
                       help="the attention implementation of a transformers model: eager, sdpa, or "
                            "another transformers knows (default: the model's own)")
    probe.add_argument("--context-reserve", metavar="SIZE", default=None,
                       help="the CUDA context's memory to subtract (default: measured when CUDA is "
                            "present, else 0.4 GiB)")
    probe.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    probe.add_argument("--verify", action="store_true",
                       help=f"also train {VERIFY_STEPS} real steps under the budget (needs CUDA)")
    probe.set_defaults(func=cmd_probe)


def _add_demo(commands, debug) -> None:
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


def _add_cache(commands, debug) -> None:
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
        from autofit.commands.models import ModelSpecError
        try:
            return args.func(args)
        except (UsageError, ModelSpecError) as e:
            return _fail(e, EXIT_USAGE, debug)
        except KeyboardInterrupt:
            print("autofit: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:
            return _fail(f"unexpected {one_line(e)}" + ("" if debug else "; rerun with --debug for "
                                                         "the traceback"), EXIT_INTERNAL, debug)


def entry() -> None:
    """The `autofit` console script."""
    # The imports (torch, transformers) leave about a million long-lived objects, which every full
    # collection during a probe's fake walks would scan again (a large share of a BERT-base probe: benchmarks/README.md, probe_speed.py):
    # a short-lived process keeps them out of the collector, and runs no automatic collection at
    # all (a little more time saved, for a few MB; an attempt's recovery collects by itself, gpu/oom).
    # `main` (the library's way in) leaves the collector alone.
    gc.freeze()
    gc.disable()
    sys.exit(main())


def _fail(error, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"autofit: error: {error}", file=sys.stderr)
    return code


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


if __name__ == "__main__":
    entry()
