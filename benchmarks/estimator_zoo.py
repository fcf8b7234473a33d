"""Which transformers families the estimator follows, and how close it is, one step each.

For every tiny model of the zoo (tests/models.py: encoders, decoders, encoder-decoders, MoE, vision;
default dropout, random init, one global batch of 4 rows), the table gives how the estimator
predicts a training step (on fake tensors; measured on 1 and 2 real rows when fake tensors cannot
follow the model, and why; or not at all, the capacity check falling back), the predicted peak
of one fp32 step of the whole batch as this CPU runs it (`device_type="cpu"`), and the peak the
simulated GPU measures for the same real step (the second of two, when optimizer state exists).

    python benchmarks/estimator_zoo.py     # about 1 minute on 2 shared cores
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from common import ROOT, print_environment, setup, table

sys.path.insert(0, os.path.join(ROOT, "tests"))  # the zoo's builders are shared with the tests

from models import zoo  # noqa: E402

from autofit.engine.batches import rows_of  # noqa: E402
from autofit.engine.token_loss import token_counter  # noqa: E402
from autofit.gpu.device import SimulatedDevice  # noqa: E402
from autofit.estimator.estimate import estimate  # noqa: E402
from autofit.plans.plan import Plan  # noqa: E402
from autofit.gpu.simulate import simulate_gpu  # noqa: E402
from autofit.sizes import format_size  # noqa: E402
from autofit.errors import one_line  # noqa: E402
from autofit.engine.step import StepRunner  # noqa: E402


def measured_peak(model, batch, plan) -> int:
    """The simulated GPU's peak of the second of two real steps under `plan`."""
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        model.train()
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device,
                            count_tokens=token_counter(model))
        runner.run(batch, plan)
        runner.run(batch, plan)
        peak = runner.attempt_peak()
        runner.close()
    return peak


def main() -> None:
    setup()
    print_environment("estimator zoo: estimated or fallback, predicted vs measured peak of one step")
    rows, heard = [], []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: heard.append(record.getMessage().split("(", 1)[-1].split(");")[0])
    logging.getLogger("autofit").addHandler(handler)
    logging.getLogger("autofit").setLevel(logging.INFO)
    for name, build in zoo().items():
        model, batch = build(0)
        plan = Plan(rows_of(batch))
        heard.clear()
        try:
            est = estimate(model, batch, plan, device_type="cpu")
            predicted = est.peak_bytes
            outcome = "fake tensors" if est.method == "fake" else f"sampled: {heard[0][:60]}"
        except Exception as error:  # what the capacity check would log before falling back
            predicted, outcome = None, f"fallback: {one_line(error)[:60]}"
        measured = measured_peak(build(0)[0], batch, plan)
        error = "" if predicted is None else f"{(predicted - measured) / measured:+.2%}"
        rows.append([name, type(model).__name__, f"{sum(p.numel() for p in model.parameters()) / 1e3:.1f}k",
                     outcome, format_size(predicted) if predicted else "", format_size(measured), error])
    print(table(["model", "class", "params", "estimator", "predicted", "measured", "error"], rows,
                align="llrlrrr"))
    fake = sum(r[3] == "fake tensors" for r in rows)
    sampled = sum(r[3].startswith("sampled") for r in rows)
    print(f"\n{fake} of {len(rows)} families estimated on fake tensors, {sampled} measured on a real sample "
          f"of 1 and 2 rows, {len(rows) - fake - sampled} fall back (the run as with capacity_check=False).")


if __name__ == "__main__":
    main()
