import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

import autofit
from autofit.engine.controller import Attempt
from autofit.errors import DoesNotFit
from autofit.recipes.evaluate import EvalResult
from autofit.recipes.eval_sizer import EvalAttempt
from autofit.diagnosis.explain import explain
from autofit.diagnosis.fixes import fixes_for
from autofit.plans.plan import Plan
from autofit.recipes.run import RunResult

MiB, GiB = 2**20, 2**30
OOM = "CUDA out of memory. Tried to allocate 120.00 MiB."


def mem(params=0, grads=0, optimizer=0, activations=0, other=0):
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
            "other": other}


def oom(plan, memory, reason="start: the whole global batch at once", step=0, where="forward/backward"):
    return Attempt(plan, "oom", reason, sum(memory.values()), step, OOM, where, memory)


def ok(plan, reason, step=0):
    return Attempt(plan, "ok", reason, 1 * GiB, step)


def keys(memory, plan, budget=None):
    return [f.key for f in fixes_for(memory, plan, budget)]


# -- the rules --------------------------------------------------------------------------------------

def test_activation_dominated_failure_asks_for_accumulation_amp_and_checkpointing():
    # SciBERT-like: 420 MiB of weights on a 15 GiB card, the rest is activations of a big batch
    memory = mem(params=420 * MiB, activations=12 * GiB)
    big = Plan.for_batch(32)
    assert keys(memory, big, 15 * GiB) == ["accumulation", "amp", "checkpointing"]
    assert keys(memory, Plan.for_batch(32, 1), 15 * GiB) == ["amp", "checkpointing"]  # micro-batch 1
    assert keys(memory, big.replace(precision="bf16", checkpointing=True), 15 * GiB) == ["accumulation"]
    result = RunResult(plan=Plan.for_batch(32, 16), attempts=[
        oom(big, memory),
        ok(Plan.for_batch(32, 16), "smaller micro-batch, more accumulation (not below 8)"),
        ok(Plan.for_batch(32, 16), "kept: fitted the previous global batch", step=1)])
    text = explain(result)
    assert text.splitlines()[0] == ("autofit: 3 attempts over 2 global steps, 1 ran out of memory; the run "
                                    "finished with micro 16 x 2, fp32.")
    assert text.splitlines()[1] == ("step 0, attempt 1 (micro 32 x 1, fp32): out of memory in "
                                    "forward/backward.")
    assert ("  memory at the failure: 12.41 GiB (params 420.00 MiB, grads 0 bytes, optimizer 0 bytes, "
            "activations 12.00 GiB, other 0 bytes)") in text
    assert ("  - gradient accumulation: activations (12.00 GiB, 97%) dominate and grow with the "
            "micro-batch; micro-batches of 16 with 2 accumulation steps keep the global batch and its "
            "gradient while holding about half the activations. [autofit did this next]") in text
    assert "  - mixed precision (AMP): bf16 autocast" in text
    assert "  - activation checkpointing: model.gradient_checkpointing_enable()" in text
    assert text.count("[autofit did this next]") == 1
    assert text.splitlines()[-1] == (
        "  autofit then: micro 16 x 2, fp32 (micro-batch 32 -> 16 with 2 accumulation steps) because "
        "smaller micro-batch, more accumulation (not below 8); it fitted.")
    assert "lighter model" not in text and "previous optimizer" not in text


def test_a_second_optimizer_left_from_an_earlier_phase_is_named():
    # the 2 GiB report: pretraining's AdamW still alive when fine-tuning builds a new one
    plan = Plan.for_batch(16, 8)
    memory = mem(params=300 * MiB, grads=300 * MiB, optimizer=1200 * MiB, activations=200 * MiB)
    assert keys(memory, plan, 2 * GiB) == ["free-previous-optimizer", "offload"]
    text = explain(RunResult(plan=plan, attempts=[
        oom(plan, memory, where="optimizer.step"),
        ok(plan.replace(offload_optimizer=True), "optimizer state moves to CPU memory")]))
    assert ("  - free a previous optimizer: the optimizer state (1.17 GiB) is 4.0x the parameters, more than "
            "the 2x one AdamW keeps; an optimizer from an earlier phase (pretraining before fine-tuning, "
            "say) is probably still alive. `del optimizer, scheduler` and anything else that references "
            "them, then `gc.collect(); torch.cuda.empty_cache()`, before building the next one.") in text
    assert ("  - optimizer offload: its state (1.17 GiB, 60%) can live in CPU memory and be stepped there, "
            "at the cost of host-device copies. [autofit did this next]") in text
    assert "out of memory in optimizer.step." in text
    # the same leftover seen as memory held before the step: 2x params outside this run's optimizer
    held = mem(params=300 * MiB, activations=400 * MiB, other=600 * MiB)
    assert keys(held, plan, 2 * GiB) == ["free-previous-optimizer", "held-tensors", "amp", "checkpointing"]
    assert ("memory held outside the step (600.00 MiB) is about 2x the parameters, the size of an "
            "AdamW's two moments") in fixes_for(held, plan, 2 * GiB)[0].text
    one_adamw = mem(params=300 * MiB, optimizer=600 * MiB, activations=100 * MiB)
    assert keys(one_adamw, plan, 2 * GiB) == ["offload"]
    # without a known budget the memory in use at the failure stands for it: 1.17 GiB of state > 1000 MiB
    assert keys(one_adamw, plan) == ["lighter-model", "offload"]
    assert "of the 1000.00 MiB in use at the failure" in fixes_for(one_adamw, plan)[0].text


def test_parameters_too_big_for_the_budget_ask_for_a_lighter_model():
    plan = Plan.for_batch(8, 1, precision="bf16", checkpointing=True)
    memory = mem(params=1200 * MiB, grads=600 * MiB, activations=200 * MiB)
    assert keys(memory, plan, 2 * GiB) == ["lighter-model"]
    error = DoesNotFit("no plan of the ladder fits global batch 8 at step 0 on NVIDIA T4 (2.00 GiB).",
                       attempts=[oom(plan, memory)], breakdown=memory, budget=2 * GiB)
    text = explain(error)
    assert text.splitlines()[:2] == [
        "autofit: no plan of the ladder fits global batch 8 at step 0 on NVIDIA T4 (2.00 GiB).",
        "1 attempts, 1 ran out of memory."]
    assert ("  - a lighter model variant: the parameters (1.17 GiB) with their gradients and AdamW state "
            "need about 4.69 GiB before any activation, 234% of the 2.00 GiB budget; no batch size fixes "
            "that. Take a smaller variant (DistilBERT instead of BERT-base, TinyBERT instead of "
            "DistilBERT), freeze layers, or train adapters (LoRA)") in text
    assert ("  memory at the failure: 1.95 GiB of a 2.00 GiB budget (params 1.17 GiB, grads 600.00 MiB, "
            "optimizer 0 bytes, activations 200.00 MiB, other 0 bytes)") in text
    assert text.splitlines()[-1] == (
        "  autofit then: the ladder had no step left, so it raised DoesNotFit; the fixes above that a plan "
        "cannot make (a lighter model, freeing what your code holds) are yours.")
    # with the optimizer offloaded, only params and grads count
    offloaded = plan.replace(offload_optimizer=True)
    assert "with their gradients need about 2.34 GiB" in fixes_for(memory, offloaded, 2 * GiB)[0].text
    assert keys(mem(params=400 * MiB, activations=1500 * MiB), plan, 2 * GiB) == []  # 1.56 GiB < 90%


def test_batches_already_on_the_device_are_named():
    plan = Plan.for_batch(16, 16)
    memory = mem(params=100 * MiB, grads=100 * MiB, optimizer=200 * MiB, activations=600 * MiB,
                 other=500 * MiB)
    assert keys(memory, plan) == ["held-tensors", "amp", "checkpointing"]
    text = explain(RunResult(plan=plan, attempts=[oom(plan, memory)]))
    assert ("  - batches or tensors already on the device: 500.00 MiB (33%) was held outside the step. "
            "Keep batches on the CPU (autofit moves each micro-batch itself), keep Python numbers "
            "(loss.item()) instead of losses or outputs across steps") in text
    assert text.splitlines()[-1] == "  autofit then: no later attempt of this step was recorded."


def test_repeated_fixes_are_shortened_and_the_text_is_deterministic():
    plan = Plan.for_batch(32)
    memory = mem(params=100 * MiB, activations=900 * MiB)
    second = Plan.for_batch(32, 16)
    why = "smaller micro-batch, more accumulation (not below 8)"
    attempts = [oom(plan, memory), oom(second, memory, why),
                ok(Plan.for_batch(32, 8), why)]
    text = explain(RunResult(plan=Plan.for_batch(32, 8), attempts=attempts))
    assert text == explain(RunResult(plan=Plan.for_batch(32, 8), attempts=list(attempts)))
    assert "step 0, attempt 2 (micro 16 x 2, fp32): out of memory in forward/backward." in text
    assert "  - gradient accumulation (as above) [autofit did this next]" in text
    assert "  - mixed precision (AMP) (as above)" in text
    assert text.count("gradient accumulation:") == 1


def test_no_oom_no_memory_and_wrong_input():
    plan = Plan.for_batch(4)
    assert explain(RunResult(plan=plan, attempts=[ok(plan, "start")])).splitlines() == [
        "autofit: 1 attempts over 1 global steps, 0 ran out of memory; the run finished with "
        "micro 4 x 1, fp32.",
        "No attempt ran out of memory; nothing to fix."]
    text = explain(RunResult(plan=plan, attempts=[oom(plan, {})]))
    assert "  memory at the failure: not recorded." in text
    with pytest.raises(TypeError, match="explain\\(\\) takes what autofit.run returned"):
        explain(plan)


def test_evaluation_attempts_are_explained():
    result = EvalResult(loss=0.5, samples=24, batch_size=12, attempts=[
        EvalAttempt(24, "oom", "start: batch_size=24", 0, 0, 0, OOM),
        EvalAttempt(12, "ok", "halved after 24 rows ran out of memory", 0, 0)])
    assert explain(result).splitlines() == [
        "autofit evaluation: 2 attempts, 1 ran out of memory.",
        "evaluation batch 0: 24 rows ran out of memory (sample 0 on).",
        f"  error: {OOM}",
        "  autofit then: evaluated 12 rows at a time (the evaluation batch halved; the training plan "
        "untouched); it fitted."]


def test_a_runs_evaluation_attempts_are_explained_after_its_training_attempts():
    plan = Plan.for_batch(8)
    result = RunResult(plan=plan, attempts=[ok(plan, "start")])
    result.eval_attempts = [EvalAttempt(32, "oom", "start: start_batch_size=32", 0, 0, 0, OOM),
                            EvalAttempt(16, "ok", "halved after 32 rows ran out of memory", 0, 0)]
    assert explain(result).splitlines()[:3] == [
        "autofit: 1 attempts over 1 global steps, 0 ran out of memory; the run finished with "
        "micro 8 x 1, fp32.",
        "evaluation: 2 attempts, 1 ran out of memory.",
        "evaluation batch 0: 32 rows ran out of memory (sample 0 on)."]


# -- a real failure -----------------------------------------------------------------------------------

def test_explain_a_real_does_not_fit_from_run():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=100,
        max_position_embeddings=64, hidden_dropout_prob=0, attention_probs_dropout_prob=0))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 100, (4, 16), generator=g),
             "attention_mask": torch.ones(4, 16, dtype=torch.long),
             "labels": torch.randint(0, 2, (4,), generator=g)}]
    with pytest.raises(autofit.DoesNotFit) as info:
        autofit.run(model, data, budget="150KiB", progress=False, capacity_check=False)
    error = info.value
    text = explain(error)
    lines = text.splitlines()
    n = len(error.attempts)
    assert n >= 2 and all(a.outcome == "oom" for a in error.attempts)
    assert lines[0] == "autofit: " + str(error).splitlines()[0]
    assert lines[1] == f"{n} attempts, {n} ran out of memory."
    assert [line for line in lines if line.startswith("step ")] == [
        f"step 0, attempt {i + 1} ({a.plan.describe()}): out of memory in {a.where}."
        for i, a in enumerate(error.attempts)]
    # 90.5 KiB of weights: with gradients and AdamW state far more than 150 KiB, whatever the plan
    assert ("  - a lighter model variant: the parameters (90.50 KiB) with their gradients and AdamW state "
            "need about 362.00 KiB before any activation, 241% of the 150.00 KiB budget") in text
    assert text.count("a lighter model variant (as above)") == n - 1
    assert lines[-1].startswith("  autofit then: the ladder had no step left, so it raised DoesNotFit")


def test_explain_a_refusal_of_the_capacity_check():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=100,
        max_position_embeddings=64, hidden_dropout_prob=0, attention_probs_dropout_prob=0))
    data = [{"input_ids": torch.randint(0, 100, (4, 16)), "labels": torch.randint(0, 2, (4,))}]
    with pytest.raises(autofit.DoesNotFit) as info:
        autofit.run(model, data, budget="150KiB", progress=False)
    error = info.value
    assert error.attempts == [] and error.plan.offload_optimizer and error.plan.micro_batch_size == 1
    lines = explain(error).splitlines()
    assert lines[1] == "0 attempts, 0 ran out of memory."
    assert lines[2].startswith("The estimate before training, by kind: ")
    assert lines[3].startswith("  - a lighter model variant: the parameters (90.50 KiB) with their gradients")


def test_the_global_batch_autofit_read_onto_the_device_is_not_blamed_on_the_user():
    """A map-style Dataset is batched by autofit, inside the simulated GPU: the global batch lives
    on the device because autofit put it there, so it is no 'tensor held outside the step'.
    The first global batch is read before the device opens (once, from the first epoch's
    iterator), so the fault is injected into the second one, which is collated on the device."""
    import torch

    import autofit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    forwards = []

    def fail_on_second_batch(module, args):
        forwards.append(True)
        if len(forwards) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
    model.register_forward_pre_hook(fail_on_second_batch)
    data = torch.utils.data.TensorDataset(torch.randn(64, 1024), torch.randint(0, 2, (64,)))
    result = autofit.run(model, data, batch_size=32, budget="64MiB", cache=False, progress=False,
                         capacity_check=False,
                         loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert [(a.step, a.outcome) for a in result.attempts] == [(0, "ok"), (1, "oom"), (1, "ok")]
    failed = result.attempts[1]
    memory = failed.memory
    assert memory["batch"] == 32 * 1024 * 4 + 512 and memory["other"] == 0
    assert "held-tensors" not in [f.key for f in fixes_for(memory, failed.plan, 64 * MiB)]
    text = explain(result)
    assert "batch 128.50 KiB" in text and "Keep batches on the CPU" not in text
