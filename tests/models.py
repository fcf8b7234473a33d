"""Tiny models and batches shared by the tests: plain builders, importable as `from models import ...`.

Everything is seeded and dropout-free, so two builds give identical weights and a step is
deterministic. Sizes are the smallest that still exercise the real Hugging Face code paths.
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

VOCAB = 100
MAX_POSITIONS = 64


def tiny_bert(seed: int = 0, num_labels: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0,
                        attention_probs_dropout_prob=0, num_labels=num_labels)
    return BertForSequenceClassification(config)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=MAX_POSITIONS,
                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)


def bert_batch(rows: int = 8, seq: int = 16, seed: int = 0, num_labels: int = 2) -> dict:
    """{'input_ids', 'attention_mask', 'labels'} for sequence classification (labels: one per row)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (rows, seq), generator=g),
        "attention_mask": torch.ones(rows, seq, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (rows,), generator=g),
    }


def gpt2_batch(rows: int = 8, seq: int = 16, seed: int = 0) -> dict:
    """{'input_ids', 'labels'} for a causal LM; row i has its last `i % seq` labels set to -100, so rows
    carry different numbers of label tokens (what token weighting is about)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = input_ids.clone()
    for i in range(rows):
        if i % seq:
            labels[i, seq - i % seq:] = -100
    return {"input_ids": input_ids, "labels": labels}
