import json
import math
import re

import pytest
import torch

from autofit.plans.ladder import BUSY_FLOOR, Either, FunctionMove, Move, SetField, ShrinkMicroBatch, as_move, checkpointing, default_ladder, mixed_precision, offload_optimizer, step_down
from autofit.plans.sizelog import SizeLog, config_of
from autofit.plans.plan import Plan

SHRINK_8 = "smaller micro-batch, more accumulation (not below 8)"
SHRINK_1 = "smaller micro-batch, more accumulation (not below 1)"
BF16 = "bf16 autocast halves activation memory"
FP16 = "fp16 autocast halves activation memory"
CKPT = "activation checkpointing recomputes activations in backward"
OFFLOAD = "optimizer state moves to CPU memory"


def walk(move, plan, limit=50):
    """Every (plan, reason) the move steps through until it returns None."""
    out = []
    while (taken := move.take(plan)) is not None:
        plan, why = taken
        out.append((plan, why))
        assert len(out) < limit, f"the ladder does not end: {out[-3:]}"
    assert move(plan) is None
    return out


def P(micro, acc=1, precision="fp32", ckpt=False, offload=False):
    return Plan(micro_batch_size=micro, accumulation_steps=acc, precision=precision, checkpointing=ckpt,
                offload_optimizer=offload)


def test_default_ladder_auto_walks_the_documented_order():
    # DESIGN.md / default_ladder's docstring: micro-batch down to BUSY_FLOOR, bf16, checkpointing,
    # micro-batch down to 1, optimizer offload, then nothing.
    assert BUSY_FLOOR == 8
    assert walk(default_ladder(SizeLog(), "auto"), P(64)) == [
        (P(32, 2), SHRINK_8),
        (P(16, 4), SHRINK_8),
        (P(8, 8), SHRINK_8),
        (P(8, 8, "bf16"), BF16),
        (P(8, 8, "bf16", ckpt=True), CKPT),
        (P(4, 16, "bf16", ckpt=True), SHRINK_1),
        (P(2, 32, "bf16", ckpt=True), SHRINK_1),
        (P(1, 64, "bf16", ckpt=True), SHRINK_1),
        (P(1, 64, "bf16", ckpt=True, offload=True), OFFLOAD),
    ]


def test_default_ladder_is_auto_by_default_and_a_plain_callable():
    ladder = default_ladder(SizeLog())
    assert ladder(P(64)) == P(32, 2)
    assert ladder(P(8, 8)) == P(8, 8, "bf16")
    assert repr(ladder) == ("ShrinkMicroBatch(floor=8) | SetField(precision='bf16') | "
                            "SetField(checkpointing=True) | ShrinkMicroBatch(floor=1) | "
                            "SetField(offload_optimizer=True); "
                            "first after optimizer.step: SetField(per_parameter_step=True) | "
                            "SetField(offload_optimizer=True); "
                            "first after optimizer.state: SetField(offload_optimizer=True)")


def test_default_ladder_without_bf16_uses_fp16():
    assert walk(default_ladder(SizeLog(), "auto", bf16_supported=False), P(8, 8)) == [
        (P(8, 8, "fp16"), FP16),
        (P(8, 8, "fp16", ckpt=True), CKPT),
        (P(4, 16, "fp16", ckpt=True), SHRINK_1),
        (P(2, 32, "fp16", ckpt=True), SHRINK_1),
        (P(1, 64, "fp16", ckpt=True), SHRINK_1),
        (P(1, 64, "fp16", ckpt=True, offload=True), OFFLOAD),
    ]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_fixed_precision_never_changes(precision):
    ladder = default_ladder(SizeLog(), precision)
    assert walk(ladder, P(32, 1, precision)) == [
        (P(16, 2, precision), SHRINK_8),
        (P(8, 4, precision), SHRINK_8),
        (P(8, 4, precision, ckpt=True), CKPT),
        (P(4, 8, precision, ckpt=True), SHRINK_1),
        (P(2, 16, precision, ckpt=True), SHRINK_1),
        (P(1, 32, precision, ckpt=True), SHRINK_1),
        (P(1, 32, precision, ckpt=True, offload=True), OFFLOAD),
    ]


def test_auto_ladder_does_not_switch_an_already_mixed_plan():
    assert [p for p, _ in walk(default_ladder(SizeLog(), "auto"), P(8, 1, "fp16"))] == [
        P(8, 1, "fp16", ckpt=True), P(4, 2, "fp16", ckpt=True), P(2, 4, "fp16", ckpt=True),
        P(1, 8, "fp16", ckpt=True), P(1, 8, "fp16", ckpt=True, offload=True)]


def test_uneven_sizes_stop_at_the_floor_and_round_accumulation_up():
    # A move only sees the plan, so the batch it keeps covering is micro * accumulation, which grows
    # when the micro-batch does not divide it: 12 -> 8 x 2 (covers 16) -> 4 x 4, not 4 x 3. The
    # controller renormalises every step-down with Plan.with_micro_batch(size, real global batch).
    ladder = default_ladder(SizeLog(), "auto")
    assert [p for p, _ in walk(ladder, Plan.for_batch(12))] == [
        P(8, 2), P(8, 2, "bf16"), P(8, 2, "bf16", ckpt=True), P(4, 4, "bf16", ckpt=True),
        P(2, 8, "bf16", ckpt=True), P(1, 16, "bf16", ckpt=True), P(1, 16, "bf16", ckpt=True, offload=True)]
    # Below the floor the first shrink has nothing to do: bf16 comes first.
    assert [p for p, _ in walk(ladder, P(5))] == [
        P(5, 1, "bf16"), P(5, 1, "bf16", ckpt=True), P(2, 3, "bf16", ckpt=True),
        P(1, 6, "bf16", ckpt=True), P(1, 6, "bf16", ckpt=True, offload=True)]
    assert P(4, 4).with_micro_batch(4, 12) == P(4, 3)


def test_a_fully_stepped_down_plan_has_no_step_left():
    ladder = default_ladder(SizeLog(), "auto")
    assert ladder(P(1, 64, "bf16", ckpt=True, offload=True)) is None
    assert ladder.take(P(1, 64, "bf16", ckpt=True, offload=True)) is None


# -- SizeLog ------------------------------------------------------------------------------------

def test_sizelog_records_largest_fit_and_smallest_failure_per_configuration():
    log = SizeLog()
    log.record(P(8), True)
    log.record(P(4), True)
    log.record(P(32), False)
    log.record(P(64), False)
    log.record(P(16, precision="bf16"), True)
    assert (log.fit(P(1)), log.fail(P(1))) == (8, 32)
    assert (log.fit(P(1, precision="bf16")), log.fail(P(1, precision="bf16"))) == (16, None)
    assert log.fit(P(1, ckpt=True)) is None
    # Without a length a fit holds at every length, a failure fails at every length.
    assert log.fits == {("fp32", False, False): {math.inf: 8}, ("bf16", False, False): {math.inf: 16}}
    assert log.fails == {("fp32", False, False): {0: 32}}
    assert config_of(P(2, 3, "bf16", ckpt=True, offload=True)) == ("bf16", True, True)


def test_sizelog_caps_sizes_at_the_global_batch():
    log = SizeLog()
    log.record(P(64), True, global_batch=10)
    log.record(P(64, precision="bf16"), False, global_batch=10)
    assert log.fit(P(1)) == 10
    assert log.fail(P(1, precision="bf16")) == 10


def test_a_failure_at_or_below_a_fit_forgets_the_fit():
    # It fitted before the optimizer state existed; it does not any more.
    log = SizeLog()
    log.record(P(16), True)
    log.record(P(32), False)
    assert log.fit(P(1)) == 16
    log.record(P(16), False)
    assert log.fits == {} and log.fit(P(1)) is None and log.fail(P(1)) == 16


# -- SizeLog: row lengths -------------------------------------------------------------------------

def test_a_fit_holds_for_shorter_rows_and_a_failure_for_longer_ones():
    log = SizeLog()
    log.record(P(16), True, length=100)
    log.record(P(8), True, length=400)
    log.record(P(32), False, length=100)
    log.record(P(12), False, length=400)
    assert [log.fit(P(1), length=n) for n in (50, 100, 101, 400, 401)] == [16, 16, 8, 8, None]
    assert [log.fail(P(1), length=n) for n in (50, 100, 399, 400, 1000)] == [None, 32, 32, 12, 12]
    assert [log.known_to_fail(P(12), length=n) for n in (100, 400)] == [False, True]


def test_the_length_being_trained_is_the_default_for_queries_and_records():
    log = SizeLog()
    log.length = 400
    log.record(P(8), True)
    log.record(P(16), False)
    log.length = 100
    log.record(P(16), True)
    assert log.fits == {("fp32", False, False): {400: 8, 100: 16}}
    assert log.fails == {("fp32", False, False): {400: 16}}
    assert (log.fit(P(1)), log.fail(P(1))) == (16, None)
    log.length = 400
    assert (log.fit(P(1)), log.fail(P(1))) == (8, 16)


def test_a_failure_forgets_only_the_fits_of_as_long_rows_and_as_many():
    log = SizeLog()
    log.record(P(16), True, length=100)
    log.record(P(8), True, length=400)
    log.record(P(8), False, length=200)   # 8 fails at 200: the fit at 400 was wrong, the 100 one stands
    assert log.fits == {("fp32", False, False): {100: 16}}
    assert log.longest_fit(P(1)) == (100, 16)
    log.record(P(4), False, length=50)
    assert log.fits == {} and log.longest_fit(P(1)) is None


def test_probe_up_reads_the_sizes_of_the_length():
    log = SizeLog()
    log.record(P(8), True, length=400)
    log.record(P(9), False, length=400)    # settled at 8 for long rows
    log.record(P(8), True, length=100)
    assert log.probe_up(P(8, 8), 64, length=400) is None
    assert log.probe_up(P(8, 8), 64, length=100) == P(64, 1)   # nothing failed at 100 or shorter
    log.record(P(64), False, length=100)
    assert log.probe_up(P(8, 8), 64, length=100) == P(36, 2)


def test_sizelog_survives_json():
    log = SizeLog()
    log.record(P(16), True, length=100)
    log.record(P(8, precision="bf16"), True)
    log.record(P(32), False, length=100)
    log.record(P(64, ckpt=True), False)
    data = json.loads(json.dumps(log.to_json()))
    assert data == {"fits": [[["fp32", False, False], [[100, 16]]], [["bf16", False, False], [[None, 8]]]],
                    "fails": [[["fp32", False, False], [[100, 32]]], [["fp32", True, False], [[None, 64]]]]}
    back = SizeLog.from_json(data)
    assert (back.fits, back.fails) == (log.fits, log.fails)


def test_known_to_fail():
    log = SizeLog()
    log.record(P(16), False)
    assert [log.known_to_fail(P(n)) for n in (8, 15, 16, 17, 64)] == [False, False, True, True, True]
    assert not log.known_to_fail(P(64, precision="bf16"))
    assert not log.known_to_fail(P(64, ckpt=True))


@pytest.mark.parametrize("fit, fail, plan, global_batch, expected", [
    (16, 32, P(16, 4), 64, P(24, 3)),       # halfway between the fit and the failure
    (16, None, P(16, 4), 64, P(64, 1)),     # nothing failed yet: try the whole batch
    (16, 20, P(16, 4), 64, P(18, 4)),
    (16, 18, P(16, 4), 64, P(17, 4)),
    (16, 17, P(16, 4), 64, None),           # settled: 16 fits, 17 fails
    (64, None, P(64, 1), 64, None),         # the whole batch fits
    (16, 32, P(8, 8), 64, None),            # the plan is not at the largest fit
    (None, 32, P(16, 4), 64, None),         # no fit known
    (10, None, P(10, 1), 12, P(12, 1)),
])
def test_probe_up(fit, fail, plan, global_batch, expected):
    log = SizeLog()
    if fit is not None:
        log.record(P(fit), True)
    if fail is not None:
        log.record(P(fail), False)
    assert log.probe_up(plan, global_batch) == expected


def test_probe_up_only_reads_the_plans_configuration():
    log = SizeLog()
    log.record(P(16), True)
    log.record(P(17), False)
    log.record(P(16, precision="bf16"), True)
    assert log.probe_up(P(16, 4), 64) is None
    assert log.probe_up(P(16, 4, "bf16"), 64) == P(64, 1, "bf16")


# -- ShrinkMicroBatch ---------------------------------------------------------------------------

def test_shrink_prefers_a_size_known_to_fit_over_blind_halving():
    log = SizeLog()
    log.record(P(24), True)
    shrink = ShrinkMicroBatch(log, floor=1)
    assert shrink(P(32, 2)) == P(24, 3)       # 16 < 24 < 32: jump to 24
    assert shrink(P(64, 1)) == P(32, 2)       # 24 is not between 32 and 64
    assert shrink(P(24, 3)) == P(12, 6)       # at the fit already: halve
    assert shrink(P(32, 2, "bf16")) == P(16, 4, "bf16")  # the fit of another configuration is ignored


def test_shrink_splits_the_true_global_batch():
    # Plan.for_batch(9, 8) is 8 x 2: it covers 16 rows but the batch has 9, which 4 x 3 covers.
    plan = Plan.for_batch(9, 8)
    shrink = ShrinkMicroBatch(SizeLog(), floor=1)
    assert shrink.take(plan, 9) == (Plan(4, 3), SHRINK_1)
    assert shrink.take(plan) == (Plan(4, 4), SHRINK_1)  # without it: the plan's own 8 x 2 = 16
    ladder = Either(mixed_precision("bf16"), shrink)
    assert step_down(ladder, plan.replace(precision="bf16"), global_batch=9) == (
        Plan(4, 3, "bf16"), SHRINK_1, [])
    assert [p for p, _ in walk_batch(shrink, plan, 9)] == [Plan(4, 3), Plan(2, 5), Plan(1, 9)]


def walk_batch(move, plan, global_batch, limit=50):
    out = []
    while (taken := move.take(plan, global_batch)) is not None:
        plan = taken[0]
        out.append(taken)
        assert len(out) < limit
    return out


def test_shrink_floor():
    shrink = ShrinkMicroBatch(SizeLog(), floor=3)
    assert [p for p, _ in walk(shrink, P(16))] == [P(8, 2), P(4, 4), P(3, 6)]
    assert shrink(P(3, 6)) is None
    assert shrink(P(2, 8)) is None
    assert repr(shrink) == "ShrinkMicroBatch(floor=3)"
    assert shrink.why == "smaller micro-batch, more accumulation (not below 3)"
    with pytest.raises(ValueError, match=re.escape("floor must be >= 1 but got 0.")):
        ShrinkMicroBatch(SizeLog(), floor=0)


# -- single moves -------------------------------------------------------------------------------

def test_set_field_moves():
    assert checkpointing()(P(8)) == P(8, ckpt=True)
    assert checkpointing()(P(8, ckpt=True)) is None
    assert offload_optimizer()(P(8)) == P(8, offload=True)
    assert offload_optimizer()(P(8, offload=True)) is None
    assert checkpointing().take(P(8)) == (P(8, ckpt=True), CKPT)
    assert repr(SetField("checkpointing", True, "x")) == "SetField(checkpointing=True)"


def test_mixed_precision_only_leaves_fp32():
    assert mixed_precision()(P(8)) == P(8, 1, "bf16")
    assert mixed_precision("fp16")(P(8)) == P(8, 1, "fp16")
    assert mixed_precision("bf16")(P(8, 1, "fp16")) is None
    assert mixed_precision("fp16")(P(8, 1, "bf16")) is None
    assert mixed_precision("bf16")(P(8, 1, "bf16")) is None
    with pytest.raises(ValueError, match=re.escape("mixed precision is 'bf16' or 'fp16' but got 'fp8'.")):
        mixed_precision("fp8")
    with pytest.raises(ValueError, match="'fp32'"):
        mixed_precision("fp32")


def test_base_move_has_no_step():
    with pytest.raises(NotImplementedError):
        Move()(P(8))


# -- composition --------------------------------------------------------------------------------

def double_accumulation(plan):
    """twice the accumulation"""
    return plan.replace(accumulation_steps=plan.accumulation_steps * 2) if plan.accumulation_steps < 4 else None


def never(plan):
    return None


def test_or_tries_the_left_move_first_then_the_right():
    move = checkpointing() | offload_optimizer()
    assert isinstance(move, Either)
    assert walk(move, P(8)) == [(P(8, ckpt=True), CKPT), (P(8, ckpt=True, offload=True), OFFLOAD)]
    reverse = offload_optimizer() | checkpointing()
    assert walk(reverse, P(8)) == [(P(8, offload=True), OFFLOAD), (P(8, ckpt=True, offload=True), CKPT)]


def test_composition_flattens_and_accepts_plain_functions_on_either_side():
    move = (checkpointing() | double_accumulation) | (never | offload_optimizer())
    assert [type(m) for m in move.moves] == [SetField, FunctionMove, FunctionMove, SetField]
    assert repr(move) == "SetField(checkpointing=True) | double_accumulation | never | SetField(offload_optimizer=True)"
    left = double_accumulation | checkpointing()  # Move.__ror__
    assert repr(left) == "double_accumulation | SetField(checkpointing=True)"
    assert walk(left, P(8)) == [(P(8, 2), "twice the accumulation"), (P(8, 4), "twice the accumulation"),
                                (P(8, 4, ckpt=True), CKPT)]


def test_function_move_reason_is_its_docstring_else_its_name():
    assert FunctionMove(double_accumulation).why == "twice the accumulation"
    assert FunctionMove(never).why == "never"
    assert FunctionMove(never).take(P(8)) is None


def test_function_move_must_return_a_plan_or_none():
    with pytest.raises(TypeError, match=re.escape("returned 3; a move returns a Plan or None.")):
        as_move(lambda plan: 3)(P(8))


def test_as_move():
    move = checkpointing()
    assert as_move(move) is move
    listed = as_move([never, checkpointing(), offload_optimizer()])
    assert isinstance(listed, Either) and walk(listed, P(8)) == [
        (P(8, ckpt=True), CKPT), (P(8, ckpt=True, offload=True), OFFLOAD)]
    assert as_move((checkpointing(),))(P(8)) == P(8, ckpt=True)
    with pytest.raises(ValueError, match=re.escape("ladder=[] has no move")):
        as_move([])
    with pytest.raises(TypeError, match=re.escape("a move is a callable Plan -> Plan | None, but got 42.")):
        as_move(42)
    with pytest.raises(TypeError, match="got 'x'"):
        checkpointing() | "x"


def test_either_of_nothing_that_steps_returns_none():
    assert Either(as_move(never), as_move(never))(P(8)) is None
    assert Either()(P(8)) is None


def test_moves_never_change_the_plan_they_are_given():
    plan = P(64)
    ladder = default_ladder(SizeLog(), "auto")
    ladder(plan)
    assert plan == P(64)


def test_settle_stops_the_probe_at_the_settled_length_only():
    log = SizeLog()
    log.settle(P(12), length=400)
    assert (log.fit(P(1), length=400), log.fail(P(1), length=400)) == (12, 13)
    assert log.probe_up(P(12, 6), 64, length=400) is None
    assert log.probe_up(P(12, 6), 64, length=100) == P(64, 1)   # shorter rows may still probe
    log.settle(P(8, precision="bf16"))                          # without a length: every length
    assert log.probe_up(P(8, 8, "bf16"), 64, length=100) is None
    assert log.longest_fit(P(1, precision="bf16")) == (None, 8)


def test_settle_proven_settles_each_length_at_its_own_size():
    log = SizeLog()
    log.record(P(16), True, length=100)
    log.record(P(8), True, length=400)
    log.settle_proven(P(1))
    assert log.fails == {("fp32", False, False): {100: 17, 400: 9}}
    assert [log.probe_up(P(n, 1), 64, length=m) for n, m in ((16, 100), (8, 400))] == [None, None]


# -- moves are offers: a move that does not apply is skipped with its reason -----------------------

class _TwoLayers(torch.nn.Module):
    """An MLP without a ModuleList/Sequential: nothing to checkpoint block by block."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


def _shape(name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "hugging face":
        from models import bert_batch, tiny_bert
        return tiny_bert(), bert_batch(rows=8, seq=8), None
    model = {"bare Linear": lambda: torch.nn.Linear(8, 3), "MLP without ModuleList": _TwoLayers,
             "ModuleList": _Blocks}[name]()
    batch = (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _rows_limit(model, rows):
    """An OOM whenever a forward sees more than `rows` rows (a budget, whatever the model's size)."""
    def hook(module, args, kwargs):
        first = next(t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor))
        if first.shape[0] > rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 MiB ({first.shape[0]} rows)")
    return model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("name,blocks", [("bare Linear", False), ("MLP without ModuleList", False),
                                         ("ModuleList", True), ("hugging face", True)])
def test_no_move_raises_whatever_the_model_shape(name, blocks):
    """precision="fp32" and 8 rows that do not fit: checkpointing is offered only where it applies,
    and the ladder goes on to micro-batches of 4 and 2 either way."""
    import autofit
    model, batch, loss_fn = _shape(name)
    hook = _rows_limit(model, 2)
    result = autofit.run(model, [batch], loss_fn=loss_fn, precision="fp32", cache=False, progress=False,
                         capacity_check=False)
    hook.remove()
    tried = [(a.plan.micro_batch_size, a.plan.checkpointing, a.outcome) for a in result.attempts]
    if blocks:
        assert tried == [(8, False, "oom"), (8, True, "oom"), (4, True, "oom"), (2, True, "ok")]
    else:
        assert tried == [(8, False, "oom"), (4, False, "oom"), (2, False, "ok")]
        assert result.attempts[1].reason == (
            f"smaller micro-batch, more accumulation (not below 1) (SetField(checkpointing=True) "
            f"skipped: activation checkpointing does not apply to {type(model).__name__}: it has no "
            f"repeated blocks (ModuleList/Sequential) and no Hugging Face switch)")
        assert "skipped" not in result.attempts[2].reason  # said once
    # Nothing autofit switched on stays on the model.
    assert not any(getattr(m.forward, "__autofit_checkpoint__", False) for m in model.modules())
    assert not getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False))


def test_offers_that_do_not_apply_name_their_reason():
    from autofit.plans.applies import not_applicable
    from autofit.gpu.device import CpuDevice

    class NoBf16(CpuDevice):
        def supports_bf16(self):
            return False

    class Scaled(torch.optim.SGD):  # its own required argument: offload copies it, never rebuilds
        def __init__(self, params, scale):
            super().__init__(params, lr=0.1 * scale)

    model = _TwoLayers()
    adamw = torch.optim.AdamW(model.parameters(), foreach=True)
    device = CpuDevice()
    assert not_applicable(P(8), model, adamw, device) is None
    assert not_applicable(P(8, precision="bf16"), model, adamw, NoBf16()) == "bf16 is not supported on cpu"
    assert not_applicable(P(8, offload=True), model, Scaled(model.parameters(), 2), device) is None
    assert not_applicable(P(8, offload=True), model, torch.optim.LBFGS(model.parameters()),
                          device) == "optimizer offload does not apply: LBFGS.step needs a closure"
    assert not_applicable(P(8, offload=True), model, adamw, device) is None
    assert not_applicable(P(8).replace(per_parameter_step=True), model, adamw, device) is None
    assert not_applicable(P(8).replace(per_parameter_step=True), model,
                          torch.optim.AdamW(model.parameters()), device) == (
        "a per-parameter optimizer step does not apply: AdamW already updates one parameter at a "
        "time (foreach off)")
    assert not_applicable(P(8).replace(per_parameter_step=True), model,
                          torch.optim.AdamW(model.parameters(), fused=True), device) == (
        "a per-parameter optimizer step does not apply: AdamW is fused (one kernel per step, no "
        "foreach temporaries)")
    # A ladder of moves that do not apply: each skipped, the first that does is taken.
    from autofit.plans.ladder import step_down
    ladder = Either(mixed_precision("bf16"), checkpointing(), ShrinkMicroBatch(SizeLog()))
    new, why, skipped = step_down(ladder, P(8), not_applicable=lambda plan: not_applicable(plan, model, adamw,
                                                                                      NoBf16()))
    assert new == P(4, 2)
    assert [reason for _, reason in skipped] == [
        "bf16 is not supported on cpu",
        "activation checkpointing does not apply to _TwoLayers: it has no repeated blocks "
        "(ModuleList/Sequential) and no Hugging Face switch"]


def _rows_over(limit):
    def loss_fn(model, batch):
        if torch.is_grad_enabled() and len(batch[0]) > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 MiB ({len(batch[0])} rows)")
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    return loss_fn


def _one_less(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size - 1) if plan.micro_batch_size > 1 else None


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(100, 2, generator=g), torch.randn(100, 1, generator=g))]


@pytest.mark.slow
def test_the_ladders_end_is_the_end(frozen_heap):
    """99 moves of one row each: 70 failures before 30 rows fit, all walked (no hidden cap)."""
    import autofit
    result = autofit.run(torch.nn.Linear(2, 1), _data(), loss_fn=_rows_over(30), precision="fp32", progress=False,
                         cache=False, capacity_check=False, ladder=_one_less)
    assert [a.outcome for a in result.attempts] == ["oom"] * 70 + ["ok"]
    assert result.plan.micro_batch_size == 30


def test_the_safety_cap_says_it_is_one(monkeypatch):
    """With the safety cap lowered to 5 the error says it was the cap, with the count and the plan left."""
    import autofit
    import autofit.engine.attempt as attempt_module
    data = _data()
    monkeypatch.setattr(attempt_module, "MAX_ATTEMPTS_PER_BATCH", 5)
    with pytest.raises(autofit.DoesNotFit, match=re.escape(
            "stopped after 5 attempts of global batch 100 at step 0 on cpu: autofit's safety cap of 5 "
            "attempts per global batch (the ladder still had micro 95 x 2, fp32 to try)")):
        autofit.run(torch.nn.Linear(2, 1), data, loss_fn=_rows_over(30), precision="fp32", progress=False,
                    cache=False, capacity_check=False, ladder=_one_less)
