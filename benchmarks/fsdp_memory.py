"""What one rank holds for the model, DDP-style replicas vs FSDP2 shards, after `autofit.run` (2 gloo
ranks, CPU). Prints a table: bytes of parameters, optimizer state and the largest gathered unit per
rank. Run: cd benchmarks && PYTHONPATH=.. python fsdp_memory.py [--hidden 128 --layers 4]"""

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch

WORLD = 2


def _bert(hidden, layers):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=4 * hidden,
        vocab_size=1000, max_position_embeddings=64, num_labels=3))


def _bytes(tensors):
    from autofit.distributed.fsdp import local
    return sum(local(t).numel() * t.element_size() for t in tensors)


def _worker(rank, init, out, hidden, layers):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                                         timeout=timedelta(seconds=120))
    import autofit
    from autofit.distributed.fsdp import fsdp_units
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 1000, (8, 32), generator=g),
             "labels": torch.randint(0, 3, (8,), generator=g)} for _ in range(2)]
    rows = []
    for kind in ("replicas (autofit's DDP)", "FSDP2 (shard=True)"):
        model = _bert(hidden, layers)
        box = {}

        def schedule(opt, box=box):  # reads the AdamW state at each step (run clears it at the end)
            def factor(step):
                box["state"] = max(box.get("state", 0), _bytes(
                    v for s in opt.state.values() for v in s.values() if v.dim() > 0))
                return 1.0
            return torch.optim.lr_scheduler.LambdaLR(opt, factor)
        autofit.run(model, data, optimizer=torch.optim.AdamW, scheduler=schedule, precision="fp32",
                    progress=False, capacity_check=False, cache=False, shard=kind.startswith("FSDP2"))
        units = fsdp_units(model)
        # The most one block unit gathers at once (its whole parameters, every rank's shard).
        largest = max((sum(p.numel() * p.element_size() for p in u.parameters()) for u in units
                       if u is not model), default=0)
        rows.append((kind, _bytes(model.parameters()), box["state"], largest))
    if rank == 0:
        with open(out, "w") as f:
            for r in rows:
                f.write("\t".join(map(str, r)) + "\n")
    torch.distributed.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "rows.tsv")
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "init"), out, args.hidden, args.layers))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    total = sum(p.numel() * p.element_size() for p in _bert(args.hidden, args.layers).parameters())
    print(f"BERT hidden {args.hidden}, {args.layers} layers: {total:,} B of fp32 parameters; {WORLD} ranks")
    print(f"{'per rank':28} {'params B':>12} {'AdamW state B':>14} {'largest block B':>16}")
    with open(out) as f:
        for line in f:
            kind, params, state, largest = line.rstrip("\n").split("\t")
            print(f"{kind:28} {int(params):>12,} {int(state):>14,} {int(largest):>16,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
