"""What an estimate costs as the model gets deeper: the walk of the whole model against the walk of 3
alike blocks tiled to all of them (autofit.estimator.tiling), and `autofit probe --gpu-mem 2GiB`.

For BERT-base-wide encoders (hidden 768, 12 heads, `BertConfig()` but the depth; batch 8 x 128, plans 4 x 2 then 2 x 4 offloaded,
built on meta, fake tensors only) at 4, 8, 16 and 32 layers: seconds per estimate, the first plan of
its kind (which the derived path checks once against a walk of 4 blocks) and a later one, for the
whole walk and the derived one, and whether the two agree (allocated peak, breakdown and reserved
peak, to the byte). At 4 layers there is nothing to derive (fewer than 5 blocks: the whole walk).
Then each family of the estimator zoo (tests/models.py) rebuilt with 6 layers: derived or walked
whole (and why), and the derived allocated and reserved peaks against the whole walk's. Last, the
probe's own wall time in a fresh process, with and without the derivation.

    python benchmarks/estimator_speed.py     # about 6 minutes on 2 shared cores
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from common import ROOT, print_environment, setup, table

from autofit.estimator.estimate import Estimator  # noqa: E402
from autofit.plans.plan import Plan  # noqa: E402

DEPTHS = (4, 8, 16, 32)
PLANS = (Plan(4, 2, offload_optimizer=True), Plan(2, 4, offload_optimizer=True))  # one kind, twice


def model_and_batch(layers: int):
    from transformers import BertConfig, BertForSequenceClassification
    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(num_hidden_layers=layers))
    batch = {"input_ids": torch.zeros(8, 128, dtype=torch.long, device="meta"),
             "attention_mask": torch.ones(8, 128, dtype=torch.long, device="meta"),
             "labels": torch.zeros(8, dtype=torch.long, device="meta")}
    return model, batch


def timed(estimator, plan):
    start = time.perf_counter()
    est = estimator.measure(plan)
    return time.perf_counter() - start, est


def probe_seconds(derive: bool) -> float:
    """The wall time of `autofit probe --gpu-mem 2GiB` in a fresh process (imports included)."""
    code = ("import sys; import autofit.estimator.estimate as e\n"
            f"e.Estimator.__init__.__kwdefaults__['derive_repeated'] = {derive}\n"
            "from autofit.cli import main; sys.exit(main(['probe', '--gpu-mem', '2GiB']))")
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                "decoder_layers", "num_decoder_layers")


def deepened(build, layers: int = 6):
    """A zoo model (tests/models.py) rebuilt with `layers` blocks in each stack, its batch."""
    model, batch = build(0)
    config = model.config
    for name in LAYER_FIELDS:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, layers)
    if getattr(config, "attention_layers", None):  # GPT-Neo lists each layer's attention kind
        config.attention_layers = [config.attention_layers[0]] * layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    return type(model)(config), batch


def zoo_agreement() -> None:
    """Each zoo family at 6 layers: derived or walked whole, and the bytes against the whole walk."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import zoo
    from autofit.engine.batches import rows_of
    rows = []
    for name, build in zoo().items():
        try:
            model, batch = deepened(build)
            plan = Plan(rows_of(batch))
            whole = Estimator(model, batch, device_type="cpu", derive_repeated=False).measure(plan)
            estimator = Estimator(model, batch, device_type="cpu")
            derived = estimator.measure(plan)
        except Exception as error:  # a family the estimator does not follow (see estimator_zoo)
            rows.append([name, "", "", "", f"not estimated: {type(error).__name__}"])
            continue
        repeated = getattr(estimator, "_repeated", False)
        path = "derived" if repeated and all(repeated.checked.values()) and repeated.checked else \
            "whole walk" + (f" ({next(iter(repeated.why.values()))[:50]})" if repeated and repeated.why
                            else " (no alike blocks)" if not repeated else "")
        error = (derived.peak_bytes - whole.peak_bytes) / whole.peak_bytes
        reserved = (derived.reserved_bytes - whole.reserved_bytes) / whole.reserved_bytes
        rows.append([name, whole.peak_bytes, f"{error:+.3%}", f"{reserved:+.3%}", path])
    print(table(["model (6 layers)", "whole-walk peak", "derived - whole", "reserved", "path"], rows,
                align="lrrrl"))


def main() -> None:
    setup()
    print_environment("estimate cost by depth: whole walk vs 3 alike blocks tiled")
    rows = []
    for layers in DEPTHS:
        model, batch = model_and_batch(layers)
        full = Estimator(model, batch, derive_repeated=False)
        derived = Estimator(model, batch)
        times, same = [], True
        for plan in PLANS:
            t_full, e_full = timed(full, plan)
            t_derived, e_derived = timed(derived, plan)
            times.append((t_full, t_derived))
            same &= (e_full.peak_bytes, e_full.breakdown, e_full.reserved_bytes) == \
                    (e_derived.peak_bytes, e_derived.breakdown, e_derived.reserved_bytes)
        used = bool(derived._repeated) and all(derived._repeated.checked.values())
        rows.append([layers, f"{times[0][0]:.2f}", f"{times[0][1]:.2f}", f"{times[1][0]:.2f}",
                     f"{times[1][1]:.2f}", "derived" if used else "whole walk", "yes" if same else "NO"])
    print(table(["layers", "whole: 1st plan s", "derived: 1st plan s", "whole: later plan s",
                 "derived: later plan s", "path", "same bytes"], rows, align="rrrrrll"))
    print()
    zoo_agreement()
    before, after = probe_seconds(False), probe_seconds(True)
    print(f"\nautofit probe --gpu-mem 2GiB (BERT-base, 12 layers, wall time incl. imports): "
          f"{before:.1f} s walking the whole model, {after:.1f} s derived")


if __name__ == "__main__":
    main()
