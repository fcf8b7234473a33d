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


# -- a zoo: one tiny model per transformers family that trains in a plain loop ---------------------
# (model, one global batch); default dropout, random init. Used by tests/test_estimator_zoo.py and
# benchmarks/estimator_zoo.py.

ZOO_ROWS, ZOO_SEQ = 4, 8


def _tokens(seed: int, rows: int = ZOO_ROWS, seq: int = ZOO_SEQ, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _classify(cls, config, seed: int, padded: bool = True, eos: int | None = None) -> tuple:
    torch.manual_seed(seed)
    model = cls(config)
    ids = _tokens(seed)
    if eos is not None:
        ids[:, -1] = eos
    mask = torch.ones_like(ids)
    if padded:  # the last row padded, as a real batch of uneven texts is
        ids[-1, ZOO_SEQ // 2:], mask[-1, ZOO_SEQ // 2:] = config.pad_token_id or 0, 0
    labels = torch.randint(0, 2, (ZOO_ROWS,), generator=torch.Generator().manual_seed(seed + 1))
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _causal(cls, config, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = cls(config)
    ids = _tokens(seed)
    labels = ids.clone()
    labels[-1, ZOO_SEQ // 2:] = -100  # padded label tokens
    return model, {"input_ids": ids, "labels": labels}


def _seq2seq(cls, config, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = cls(config)
    labels = _tokens(seed + 1, seq=ZOO_SEQ // 2)
    labels[-1, -1] = -100
    return model, {"input_ids": _tokens(seed), "attention_mask": torch.ones(ZOO_ROWS, ZOO_SEQ, dtype=torch.long),
                   "labels": labels}


def _images(cls, config, seed: int, size: int) -> tuple:
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    return model, {"pixel_values": torch.randn(ZOO_ROWS, 3, size, size, generator=g),
                   "labels": torch.randint(0, 2, (ZOO_ROWS,), generator=g)}


_ENC = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
            vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, pad_token_id=0)
_DEC = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
            vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS)


def zoo() -> dict:
    """name -> builder(seed) -> (model, batch), for each family."""
    import transformers as t
    return {
        "bert": lambda s: _classify(t.BertForSequenceClassification, t.BertConfig(**_ENC), s),
        "roberta": lambda s: _classify(t.RobertaForSequenceClassification,
                                       t.RobertaConfig(**{**_ENC, "pad_token_id": 1}), s),
        "distilbert": lambda s: _classify(t.DistilBertForSequenceClassification, t.DistilBertConfig(
            dim=32, n_layers=1, n_heads=2, hidden_dim=37, vocab_size=VOCAB,
            max_position_embeddings=MAX_POSITIONS), s),
        "albert": lambda s: _classify(t.AlbertForSequenceClassification,
                                      t.AlbertConfig(**_ENC, embedding_size=16), s),
        "electra": lambda s: _classify(t.ElectraForSequenceClassification,
                                       t.ElectraConfig(**_ENC, embedding_size=16), s),
        "deberta-v2": lambda s: _classify(t.DebertaV2ForSequenceClassification,
                                          t.DebertaV2Config(**_ENC), s),
        "gpt2": lambda s: _causal(t.GPT2LMHeadModel, t.GPT2Config(
            n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=MAX_POSITIONS), s),
        "gpt-neo": lambda s: _causal(t.GPTNeoForCausalLM, t.GPTNeoConfig(
            hidden_size=32, num_layers=1, attention_types=[[["global"], 1]], num_heads=2,
            vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS), s),
        "opt": lambda s: _causal(t.OPTForCausalLM, t.OPTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=37, word_embed_proj_dim=32,
            vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS), s),
        "llama": lambda s: _causal(t.LlamaForCausalLM, t.LlamaConfig(**_DEC, num_key_value_heads=1), s),
        "mistral": lambda s: _causal(t.MistralForCausalLM, t.MistralConfig(**_DEC, num_key_value_heads=1), s),
        "qwen2": lambda s: _causal(t.Qwen2ForCausalLM, t.Qwen2Config(**_DEC, num_key_value_heads=1), s),
        "mixtral": lambda s: _causal(t.MixtralForCausalLM, t.MixtralConfig(
            **{**_DEC, "intermediate_size": 64}, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2), s),  # grouped_mm on CPU wants 16-byte strides: intermediate 64
        "t5": lambda s: _seq2seq(t.T5ForConditionalGeneration, t.T5Config(**_T5), s),
        "t5-classify": lambda s: _classify(t.T5ForSequenceClassification, t.T5Config(**_T5, num_labels=2),
                                           s, padded=False, eos=1),
        "bart": lambda s: _seq2seq(t.BartForConditionalGeneration, t.BartConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, vocab_size=VOCAB,
            max_position_embeddings=MAX_POSITIONS), s),
        "vit": lambda s: _images(t.ViTForImageClassification, t.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37, image_size=16,
            patch_size=8, num_labels=2), s, 16),
        "resnet": lambda s: _images(t.ResNetForImageClassification, t.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2), s, 32),
    }


# T5's classifier reads the last token as the sentence's end: every row ends with eos (id 1).
_T5 = dict(d_model=32, d_ff=37, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16, vocab_size=VOCAB,
           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
