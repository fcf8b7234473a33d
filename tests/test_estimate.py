"""The fake-tensor estimator against the simulated GPU running the same step on real CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from autofit.engine.token_loss import token_counter
from autofit.gpu.device import SimulatedDevice
from autofit.estimator.estimate import Estimator, MemoryEstimate, estimate
from autofit.gpu.memory import KINDS
from autofit.sizes import format_breakdown
from autofit.plans.plan import Plan
from autofit.gpu.simulate import round_bytes, simulate_gpu
from autofit.engine.step import StepRunner
from autofit.engine.checkpointing import hf_checkpointing_state

VOCAB = 200


def bert(attn: str = "eager", seed: int = 0, attention_dropout: float = 0.0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=512, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=attention_dropout, num_labels=3, attn_implementation=attn))


def gpt2(attn: str = "eager", seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(
        n_embd=64, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=512, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        attn_implementation=attn))


def bert_batch(rows: int = 8, seq: int = 32) -> dict:
    """Padded rows (0, 5 or 10 pad tokens), so a real step builds the attention mask as the fake
    one always does (an all-ones mask is skipped when its values can be read)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([seq - (i % 3) * 5 for i in range(rows)])
    return {"input_ids": torch.randint(0, VOCAB, (rows, seq), generator=g),
            "attention_mask": (torch.arange(seq)[None, :] < lengths[:, None]).long(),
            "labels": torch.randint(0, 3, (rows,), generator=g)}


def gpt2_batch(rows: int = 8, seq: int = 32) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


FAMILIES = {"bert": (bert, bert_batch), "gpt2": (gpt2, gpt2_batch)}


def simulated_peak(model, batch, plan) -> int:
    """The simulated GPU's peak of the second of two real CPU steps under `plan`."""
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        model.train()
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device,
                            count_tokens=token_counter(model))
        runner.run(batch, plan)
        runner.run(batch, plan)
        peak = runner.attempt_peak()  # the whole step's peak (the optimizer step resets the counter)
        runner.close()
    return peak


PLANS = {
    "fp32": Plan(8),
    "fp32-accumulate": Plan(2, 4),
    "bf16": Plan(8, precision="bf16"),
    "fp32-checkpointing": Plan(8, checkpointing=True),
    "bf16-checkpointing-accumulate": Plan(4, 2, precision="bf16", checkpointing=True),
    "fp32-offload": Plan(8, offload_optimizer=True),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", list(PLANS))
def test_matches_the_simulated_gpu_on_a_real_cpu_step(family, case):
    build, make_batch = FAMILIES[family]
    plan, batch = PLANS[case], make_batch()
    est = estimate(build(), batch, plan, device_type="cpu")
    real = simulated_peak(build(), batch, plan)
    error = (est.peak_bytes - real) / real
    print(f"{family:5} {case:30} estimate {est.peak_bytes:>9} simulated {real:>9} error {error:+.3%}")
    # The target is 10%; the same step counted by the same counter gives the same bytes.
    assert est.peak_bytes == real


def test_breakdown_has_the_five_kinds_summing_to_the_peak():
    model, batch = gpt2(), gpt2_batch()
    params = sum(round_bytes(p.numel() * p.element_size()) for p in model.parameters())
    for plan in (Plan(8), Plan(2, 4), Plan(8, offload_optimizer=True)):
        est = estimate(model, batch, plan, device_type="cpu")
        assert isinstance(est, MemoryEstimate) and est.plan == plan
        assert tuple(est.breakdown) == KINDS
        assert sum(est.breakdown.values()) == est.peak_bytes
        assert est.breakdown["params"] == est.resident["params"] == params
        # AdamW: two moments per parameter; the step counters live on the host.
        assert est.resident == {"params": params, "grads": params, "optimizer": 2 * params}
        assert est.breakdown["optimizer"] == (0 if plan.offload_optimizer else 2 * params)
    # With accumulation the peak is in a later micro-batch, where every gradient exists.
    assert estimate(model, batch, Plan(2, 4), device_type="cpu").breakdown["grads"] == params
    est = estimate(model, batch, Plan(8), device_type="cpu")
    assert est.describe(10**9) == format_breakdown(est.breakdown, 10**9)


def test_the_user_model_optimizer_and_batch_are_untouched():
    model = bert()
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)  # a frozen parameter
    model.eval()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = bert_batch()
    model(**batch).loss.backward()
    optimizer.step()  # the optimizer has state now
    optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    inputs = {k: v.clone() for k, v in batch.items()}
    rng = torch.get_rng_state()
    for plan in (Plan(4, 2, precision="bf16", checkpointing=True), Plan(8, offload_optimizer=True)):
        for device_type in ("cpu", "cuda"):
            estimate(model, batch, plan, optimizer, device_type=device_type)
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and not isinstance(p, FakeTensor)
        assert p.device.type == "cpu" and p.grad is None and p.requires_grad == flags[n]
        assert torch.equal(p, params[n]), n
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert not model.training and not hf_checkpointing_state(model)
    assert all(torch.equal(optimizer.state[p][k], v) for p in optimizer.state
               for k, v in state[id(p)].items())
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    assert all(torch.equal(batch[k], v) for k, v in inputs.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.slow
def test_host_memory_does_not_grow_by_the_model_size():
    # A subprocess, so the peak resident set is this test's alone.
    script = textwrap.dedent("""
        import resource, torch
        from autofit.estimator.estimate import estimate
        from autofit.plans.plan import Plan
        from torch.nn.utils import skip_init  # no initialisation: fast; a copy would still show
        model = torch.nn.Sequential(*[skip_init(torch.nn.Linear, 2048, 2048) for _ in range(24)])
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        est = estimate(model, torch.randn(16, 2048), Plan(16),
                       loss_fn=lambda m, b: m(b).square().mean())
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        print(size, grown, est.peak_bytes)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split()
    size, grown, peak = map(int, out)
    print(f"model {size / 2**20:.0f} MiB, host peak grew {grown / 2**20:.0f} MiB, "
          f"estimated device peak {peak / 2**20:.0f} MiB")
    assert size > 350 * 2**20
    assert grown < size / 2  # measured: ~70 MiB (first-call imports), whatever the model size
    assert peak > 4 * size  # params, grads and two AdamW moments are on the (fake) device


def test_the_estimate_grows_with_the_batch():
    model = gpt2()
    by_rows = [estimate(model, gpt2_batch(rows), Plan(rows), device_type="cpu").peak_bytes
               for rows in (1, 4, 16)]
    assert by_rows == sorted(set(by_rows))
    by_micro = [estimate(model, gpt2_batch(16), Plan.for_batch(16, m)).peak_bytes for m in (2, 8)]
    assert by_micro == sorted(set(by_micro))


@pytest.mark.slow
def test_cuda_attention_avoids_the_quadratic_attention_matrix():
    # With attention dropout (BERT's default 0.1) CPU's SDPA takes the math path, which keeps the
    # T x T attention matrix; CUDA's flash / memory-efficient kernels do not.
    model, batch = bert("sdpa", attention_dropout=0.1), bert_batch(4, 512)
    rows, heads, seq = 4, 2, 512
    matrix = rows * heads * seq * seq * 4  # one layer's fp32 attention probabilities
    for plan in (Plan(4), Plan(4, precision="bf16", checkpointing=True)):
        cpu = estimate(model, batch, plan, device_type="cpu").peak_bytes
        cuda = estimate(model, batch, plan, device_type="cuda").peak_bytes
        print(f"{plan.describe():30} cpu {cpu / 2**20:6.2f} MiB  cuda {cuda / 2**20:6.2f} MiB")
        assert cuda < cpu - matrix
    # Eager attention is what it is on CUDA too: nothing to route. Its dropout is not: CPU saves
    # the fp32 noise (4 B a value), CUDA's fused kernel a bool mask (1 B), for each layer's
    # 4 x 2 x 512 x 512 attention probabilities, all held at the peak.
    eager = bert("eager", attention_dropout=0.1)
    cpu, cuda = (estimate(eager, batch, Plan(4), device_type=d).peak_bytes for d in ("cpu", "cuda"))
    assert cpu - cuda == 2 * rows * heads * seq * seq * (4 - 1)


def test_cuda_attention_with_checkpointing_recomputes_the_same_kernels():
    # Checkpointing recomputes the forward inside backward; a recomputation that took another
    # attention path than the forward would raise CheckpointError.
    model, batch = gpt2("sdpa"), gpt2_batch(4, 256)
    plain = estimate(model, batch, Plan(4, precision="bf16"))
    recomputed = estimate(model, batch, Plan(4, precision="bf16", checkpointing=True))
    assert recomputed.peak_bytes < plain.peak_bytes


def spy_on_fake_devices(monkeypatch) -> set:
    """The device types of every fake tensor made from now on (the test's end undoes the spy)."""
    devices = set()
    original = FakeTensor.__new__

    def spy(cls, *args, **kwargs):
        tensor = original(cls, *args, **kwargs)
        devices.add(tensor.device.type)
        return tensor

    monkeypatch.setattr(FakeTensor, "__new__", spy)
    return devices


@pytest.mark.slow
def test_no_cuda_tensor_is_ever_made(monkeypatch):
    devices = spy_on_fake_devices(monkeypatch)
    for model, batch in ((bert("sdpa"), bert_batch(4, 64)), (gpt2("sdpa"), gpt2_batch(4, 64))):
        for precision in ("fp32", "bf16", "fp16"):
            estimate(model, batch, Plan(2, 2, precision=precision, checkpointing=True))
    assert "cpu" in devices  # the spy saw the fake tensors
    assert devices <= {"cpu", "meta"}  # meta: the attention kernels' random seeds
    assert not torch.cuda.is_initialized()


def test_the_optimizer_is_the_users():
    model, batch = gpt2(), gpt2_batch()
    params = sum(round_bytes(p.numel() * p.element_size()) for p in model.parameters())
    adamw = estimate(model, batch, Plan(8), device_type="cpu")
    sgd = estimate(model, batch, Plan(8), torch.optim.SGD(model.parameters(), lr=0.1), device_type="cpu")
    momentum = estimate(model, batch, Plan(8), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                        device_type="cpu")
    assert (adamw.breakdown["optimizer"], sgd.breakdown["optimizer"],
            momentum.breakdown["optimizer"]) == (2 * params, 0, params)
    assert (adamw.optimizer, sgd.optimizer, momentum.optimizer) == ("AdamW", "SGD", "SGD")


def test_a_peak_in_the_optimizer_step_shows_its_temporaries():
    # One short row: the peak is CUDA's AdamW update, the multi-tensor implementation, whose
    # temporary (sqrt of the second moments) is one parameter-sized list.
    model = gpt2()
    params = sum(round_bytes(p.numel() * p.element_size()) for p in model.parameters())
    est = estimate(model, gpt2_batch(1, 8), Plan(1), device_type="cuda")
    assert est.breakdown == {"params": params, "grads": params, "optimizer": 2 * params,
                             "activations": 512, "other": params}  # activations: the loss total
    assert est.peak_bytes == est.step_bytes == 5 * params + 512


def test_fp16_is_measured_with_bf16_sizes():
    model, batch = gpt2(), gpt2_batch()
    bf16 = estimate(model, batch, Plan(8, precision="bf16"))
    fp16 = estimate(model, batch, Plan(8, precision="fp16"))
    assert fp16.peak_bytes == bf16.peak_bytes + 1024  # the grad scaler's two scalars
    assert fp16.plan.precision == "fp16"


def test_a_model_on_meta_estimates_like_the_same_model_on_cpu():
    batch = bert_batch()
    real = estimate(bert(), batch, Plan(4, 2))
    with torch.device("meta"):
        meta = bert()
    assert estimate(meta, batch, Plan(4, 2)).peak_bytes == real.peak_bytes


def test_an_enclosing_simulated_gpu_does_not_see_the_estimate():
    model, batch = gpt2(), gpt2_batch()
    with simulate_gpu(4096) as gpu:  # far too small for the step: fake bytes must not count
        est = estimate(model, batch, Plan(8))
        assert gpu.memory_allocated() == 0 and gpu.max_memory_allocated() == 0
    assert est.peak_bytes > 4096


def test_attention_routing_is_undone_when_the_step_fails():
    def broken(model, batch):
        raise RuntimeError("loss_fn broke")

    with pytest.raises(RuntimeError, match="loss_fn broke"):
        estimate(gpt2("sdpa"), gpt2_batch(), Plan(8), loss_fn=broken)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.slow
def test_one_estimator_measures_many_plans_like_single_estimates():
    model, batch = bert(), bert_batch()
    session = Estimator(model, batch, device_type="cpu")
    plans = [Plan(8), Plan(4, 2, checkpointing=True), Plan(8, offload_optimizer=True), Plan(8)]
    together = [session.measure(p).peak_bytes for p in plans]
    assert together == [estimate(model, batch, p, device_type="cpu").peak_bytes for p in plans]
    assert session.estimates == 4


@pytest.mark.parametrize("call, error, match", [
    (lambda m, b: estimate(m, b, Plan(8), device_type="tpu"), ValueError, "device_type must be one of"),
    (lambda m, b: estimate(m, b, {"micro_batch_size": 8}), TypeError, "plan must be an autofit.Plan"),
    (lambda m, b: estimate("bert", b, Plan(8)), TypeError, "model must be a torch.nn.Module"),
    (lambda m, b: estimate(m, b, Plan(8), loss_fn="mse"), TypeError, "loss_fn must be a callable"),
    (lambda m, b: estimate(m, b, Plan(8), optimizer="adam"), TypeError, "optimizer must be"),
    (lambda m, b: estimate(m, b, Plan(8), optimizer=torch.optim.SGD([torch.zeros(3, requires_grad=True)],
                                                                     lr=0.1)),
     ValueError, "not parameters of the model"),
    (lambda m, b: estimate(m, b, Plan(8), optimizer=lambda ps: None), TypeError, "factory returned"),
])
def test_bad_arguments_say_what_is_wrong(call, error, match):
    with pytest.raises(error, match=match):
        call(gpt2(), gpt2_batch())


def test_bert_base_one_plan_is_fast():
    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(num_labels=2))
    rows, seq = 32, 128
    batch = {"input_ids": torch.zeros(rows, seq, dtype=torch.long),
             "attention_mask": torch.ones(rows, seq, dtype=torch.long),
             "labels": torch.zeros(rows, dtype=torch.long)}
    estimate(model, batch, Plan(rows))  # imports and first-call caches
    wall, cpu = time.perf_counter(), time.process_time()
    est = estimate(model, batch, Plan(rows))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"BERT-base, batch {rows} x {seq}, one plan: {wall:.2f} s wall, {cpu:.2f} s CPU, "
          f"peak {est.peak_bytes / 2**30:.2f} GiB")
    assert 3.5 * 2**30 < est.peak_bytes < 4.5 * 2**30
    assert cpu < 6  # measured ~1 s of CPU time; the bound leaves room for a loaded machine
