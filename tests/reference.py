"""Independent plain training loops the tests compare autofit against (no autofit code inside)."""

import torch

import autofit
from autofit.gpu.device import SimulatedDevice
from autofit.engine.step import StepRunner
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel


def bert(seed=0, layers=2, hidden=32, vocab=100, dropout=0.0):
    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=64,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, num_labels=3)
    return BertForSequenceClassification(cfg)


def gpt2(seed=0, layers=2, hidden=32, vocab=100):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=2, vocab_size=vocab, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def cls_batches(n, rows=16, seq=12, vocab=100, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
             "labels": torch.randint(0, 3, (rows,), generator=g)} for _ in range(n)]


def lm_batches(n, rows=8, seq=12, vocab=100, seed=2):
    """Causal-LM batches with padding labelled -100, unevenly per row (token weighting matters)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        for r in range(rows):
            labels[r, seq - (r % 5) * 2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _weights(batch, parts, tokens):
    if tokens:
        count = lambda b: int((b["labels"][:, 1:] != -100).sum())
        total = count(batch)
        return [count(p) / total for p in parts]
    n = len(batch["input_ids"])
    return [len(p["input_ids"]) / n for p in parts]


def plain_loop(model, batches, micro_sizes, *, tokens=False, optimizer=None):
    """Split each global batch by its micro size, weight, accumulate, one AdamW step per batch."""
    opt = optimizer or torch.optim.AdamW(model.parameters())
    model.train()
    for batch, micro in zip(batches, micro_sizes):
        n = len(batch["input_ids"])
        parts = [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, n, micro)]
        for part, w in zip(parts, _weights(batch, parts, tokens)):
            (model(**part).loss * w).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def device_copy(part):
    """A micro-batch as a copy to the device makes it (`.to("cuda")`, and the simulated GPU's own
    copy of each micro-batch): every tensor its own storage, not a view at a row offset of the
    global batch. A plain loop compared bit for bit with a run on the simulated GPU feeds the model
    tensors laid out as autofit's are: a small gemm on a view whose address is not a multiple of
    16 bytes rounds differently from the same gemm on an aligned copy (measured on AVX2 for
    Linear(6, 16) on 2-3 rows and for any single-output Linear)."""
    if isinstance(part, dict):
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in part.items()}
    return type(part)(v.clone() if isinstance(v, torch.Tensor) else v for v in part)


def plain_loop_fn(model, batches, micro_sizes, loss_fn, optimizer):
    """plain_loop for any dict batch and `loss_fn(model, batch)`: rows split (each micro-batch a
    device copy, as the simulated GPU makes it), weighted by rows."""
    model.train()
    for batch, micro in zip(batches, micro_sizes):
        n = len(next(iter(batch.values())))
        for i in range(0, n, micro):
            part = device_copy({k: v[i:i + micro] for k, v in batch.items()})
            (loss_fn(model, part) * (len(next(iter(part.values()))) / n)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def max_diff(a, b) -> float:
    return max((pa.detach() - pb.detach()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def second_step_peak(model, batch, plan):
    """Peak bytes of a global step once AdamW state exists, measured on the simulated GPU."""
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        runner.run(batch, plan)
        runner.run(batch, plan)
        return runner.attempt_peak()


def storage_bytes(tensors):
    """Bytes the simulated GPU counts for these tensors' storages (512-byte rounding)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if id(s) not in seen:
            seen.add(id(s))
            total += -(-s.nbytes() // 512) * 512
    return total


def model_bytes(model):
    return storage_bytes(list(model.parameters()) + list(model.buffers()))
