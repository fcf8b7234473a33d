"""The cost model: how long one optimizer step of a plan takes, relative to the others, and the plans
worth considering for a global batch, fastest first. `autofit.estimator.capacity` searches them for
the fastest that fits.

Cost model
----------
`cost` is the relative time of one optimizer step as autofit weighs plans: 1.0 is the whole global
batch in one fp32 micro-batch, without checkpointing or offload. It is a model, not a benchmark:

- micro-batches: a micro-batch of `n` rows costs `max(n, BUSY_FLOOR) + MICRO_OVERHEAD` row-units.
  Below BUSY_FLOOR (8) rows a GPU is not kept busy, so 2 rows take as long as 8; every micro-batch
  also pays a fixed cost (kernel launches, synchronisation) worth MICRO_OVERHEAD (1) row. So fewer,
  larger micro-batches are faster, and micro-batches below 8 are heavily penalised.
- token batches (`tokens_per_row`, from `engine.batches.tokens_per_row`): the work of a micro-batch
  is its tokens, and a GPU is busy with BUSY_FLOOR rows or BUSY_TOKENS (2048) tokens, whichever
  comes first. In tokens: `max(n * tokens_per_row, floor) + floor / BUSY_FLOOR` with
  `floor = min(BUSY_TOKENS, BUSY_FLOOR * tokens_per_row)`. Rows of 256 tokens or fewer keep the row
  rule exactly (8 rows are busy; 2048 tokens at 256 per row is 8 rows); longer rows are busy sooner:
  3 rows of 1024 tokens (3072) are not charged as an idle GPU, so 8 rows of 1024 split 3 + 3 + 2
  cost 1.06, below bf16 (1.15) and checkpointing (1.33) - the exact-math plan the row rule
  (3.0) would have ranked last. Other batches (images, audio features, tabular rows) keep the row rule:
  autofit cannot tell the compute of a pixel or a feature from its count, and their rows are
  already sizeable units of work.
- precision: mixed precision (bf16/fp16) is charged MIXED_PRECISION_COST (1.15x). It runs faster
  on tensor cores, but it changes the mathematics, and autofit prefers exact math: the factor is
  set just above the accumulation cost of micro-batches of 8 rows ((8+1)/8 = 1.125), so exact
  fp32 with accumulation down to micro-batch 8 ranks before bf16 — the order the runtime ladder
  walks (accumulation first, then bf16). fp32 below micro-batch 8 ranks after bf16, and so may a
  small batch split unevenly (9 rows as 8 + 1 cost 1.8: the second micro-batch idles the GPU).
- checkpointing: CHECKPOINT_COST (4/3): backward recomputes the forward (forward is ~1/3 of a step).
  Chosen so that bf16 at micro-batch >= 8 (<= 1.125 * 1.15 = 1.29) ranks before checkpointing, as
  in the ladder.
- FSDP2 (plans of a sharded model): RESHARD_COST (1.05x) for resharding after forward (each unit is
  gathered again in backward, overlapped with compute by FSDP's prefetch), REDUCE_EACH_COST (1.08x)
  for a reduce-scatter per micro-batch with more than one (each extra one sits at the end of a
  backward). Both below the cost of halving a micro-batch of 8 rows, in the ladder's order
  (plans.ladder.sharded).
- offload: OFFLOAD_COST (3x): the optimizer update runs on the host and every step copies the
  parameters and gradients there and the parameters back. The slowest lever, used when nothing
  else fits.
"""

from __future__ import annotations

from autofit.plans.ladder import BUSY_FLOOR
from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.plans.plan import Plan
from autofit.plans.precision import get as get_precision

MICRO_OVERHEAD = 1            # fixed cost of one micro-batch, in rows
BUSY_TOKENS = 2048            # tokens that keep a GPU busy however few rows hold them: 8 rows of 256
# Each switch's factor is its entry's in plans/switches.py; named here as the docstring names them.
CHECKPOINT_COST = switches.get("checkpointing").cost        # one more forward
OFFLOAD_COST = switches.get("offload_optimizer").cost       # host update and transfers
RESHARD_COST = switches.get("reshard_after_forward").cost   # FSDP2: one more all-gather, mostly overlapped
REDUCE_EACH_COST = switches.get("reduce_each_micro_batch").cost  # FSDP2: a reduce-scatter per micro-batch


def micro_batch_sizes(global_batch: int) -> list[int]:
    """The micro-batch sizes worth trying, largest first: for each number of micro-batches k, the
    smallest size that needs only k of them (ceil(global_batch / k)). Halvings are among them;
    every other size uses more memory than one of these for the same number of micro-batches."""
    _check_positive("global_batch", global_batch)
    return sorted({-(-global_batch // k) for k in range(1, global_batch + 1)}, reverse=True)


def plan_cost(plan: Plan, global_batch: int, tokens_per_row: int | None = None) -> float:
    """Relative step time of `plan` for a global batch (1.0: one fp32 micro-batch of all of it).
    `tokens_per_row`: a token batch's positions per row (the micro-batches are weighed by their
    tokens, see the module docstring); None: by their rows."""
    _check_positive("global_batch", global_batch)
    if tokens_per_row is not None:
        _check_positive("tokens_per_row", tokens_per_row)
    unit = tokens_per_row or 1  # the work of a row: its tokens, else one row
    floor = min(BUSY_TOKENS, BUSY_FLOOR * tokens_per_row) if tokens_per_row else BUSY_FLOOR
    overhead = MICRO_OVERHEAD * floor / BUSY_FLOOR  # in rows: MICRO_OVERHEAD; in tokens: the same share

    def work(rows: int) -> float:
        return max(rows * unit, floor) + overhead

    m = min(plan.micro_batch_size, global_batch)
    full, last = divmod(global_batch, m)
    cost = (full * work(m) + (work(last) if last else 0)) / work(global_batch)
    cost *= get_precision(plan.precision).cost
    for switch in switches.SWITCHES:
        cost *= switch.cost_of(plan)
    return cost


def candidate_plans(global_batch: int, precision: str = precisions.AUTO, *, bf16_supported: bool = True,
                    allow_offload: bool = True, checkpointing: bool = True,
                    reshard: tuple = (None,), tokens_per_row: int | None = None) -> list[Plan]:
    """Every plan worth considering for a global batch, fastest first (by `plan_cost`; ties: fp32,
    no checkpointing, no offload, larger micro-batch first).

    Micro-batches: `micro_batch_sizes(global_batch)`. Precision: "auto" gives fp32 and bf16 (fp16
    where bf16 is unsupported); a fixed precision gives only itself. Checkpointing off and on
    (`checkpointing=False`: off only), offload off and on (`allow_offload=False`: off only).
    `reshard`: the values of FSDP2's reshard_after_forward to consider, for a sharded model (then
    every plan with more than one micro-batch comes also with a reduce-scatter per micro-batch);
    (None,): not sharded. `tokens_per_row`: as `plan_cost`'s.
    """
    allowed = precisions.allowed(precision, bf16_supported)
    # Each switch's values come from its entry (plans/switches.py `tries`), given its option here.
    options = {"checkpointing": checkpointing, "offload_optimizer": allow_offload, "reshard_after_forward": reshard}
    plans = [Plan.for_batch(global_batch, m, precision=p, **fields)
             for p in allowed
             for m, fields in switches.tried(options, global_batch, reshard != (None,),
                                             micro_batch_sizes(global_batch))]
    order = {p: i for i, p in enumerate(precisions.names())}
    return sorted(plans, key=lambda p: (plan_cost(p, global_batch, tokens_per_row), order[p.precision],
                                        *(bool(getattr(p, s.name)) for s in switches.SWITCHES),
                                        -p.micro_batch_size))


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int but got {value!r}.")
