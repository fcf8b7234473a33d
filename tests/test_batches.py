import collections
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import BatchEncoding, XLNetConfig, XLNetLMHeadModel

from autofit.engine.batches import IGNORE_INDEX, rows_of, dataset_batches, slice_batch, split, weights
from autofit.engine.token_loss import token_counter
from models import bert_batch, gpt2_batch, tiny_bert, tiny_gpt2

Pair = collections.namedtuple("Pair", ["inputs", "targets"])


def rows(n, width=3):
    return torch.arange(n * width).reshape(n, width)


# -- batch_size --------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [
    rows(5),
    {"input_ids": rows(5), "labels": torch.arange(5)},
    (rows(5), torch.arange(5)),
    [rows(5), {"mask": rows(5, 2)}, "a note", 3],
    Pair(rows(5), torch.arange(5)),
    BatchEncoding({"input_ids": rows(5), "attention_mask": rows(5)}),
])
def test_batch_size(batch):
    assert rows_of(batch) == 5


def test_disagreeing_tensors_are_named():
    batch = {"input_ids": rows(4), "labels": torch.arange(3)}
    with pytest.raises(ValueError, match=re.escape(
            "cannot split the batch along dimension 0: its tensors disagree (batch['input_ids'] has 4, "
            "batch['labels'] has 3); make every tensor's dimension 0 the batch dimension.")):
        rows_of(batch)
    with pytest.raises(ValueError, match=re.escape("(batch[0] has 4, batch[1]['mask'] has 2)")):
        rows_of((rows(4), {"mask": rows(2)}))


def test_zero_dimensional_tensors_are_named():
    with pytest.raises(ValueError, match=re.escape(
            "batch['scale'] is a 0-dimensional tensor and cannot be split along dimension 0; ")):
        rows_of({"input_ids": rows(4), "scale": torch.tensor(2.0)})


@pytest.mark.parametrize("batch, name", [({"a": 1}, "dict"), ([1, 2], "list"), ("text", "str"), (None, "NoneType")])
def test_a_batch_without_tensors_is_refused(batch, name):
    with pytest.raises(ValueError, match=re.escape(f"the batch holds no tensor (got {name}); ")):
        rows_of(batch)


# -- split -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, micro, sizes", [
    (10, 4, [4, 4, 2]), (10, 5, [5, 5]), (10, 10, [10]), (10, 11, [10]), (10, 1, [1] * 10), (3, 2, [2, 1]),
])
def test_split_sizes_with_a_shorter_last_part(n, micro, sizes):
    x = rows(n)
    parts = split(x, micro)
    assert [p.shape[0] for p in parts] == sizes
    assert torch.equal(torch.cat(parts), x)


def test_split_a_dict_keeps_keys_and_shares_non_tensor_leaves():
    note = object()  # a leaf that is not a tensor
    batch = {"input_ids": rows(10), "labels": torch.arange(10), "note": note}
    parts = split(batch, 4)
    assert [list(p) for p in parts] == [["input_ids", "labels", "note"]] * 3
    assert [p["labels"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert torch.equal(parts[2]["input_ids"], rows(10)[8:10])
    assert all(p["note"] is note for p in parts)


def test_split_makes_views_not_copies():
    x = rows(10)
    parts = split({"x": x}, 4)
    assert all(p["x"].untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)
    assert parts[1]["x"].storage_offset() == 12


def test_split_keeps_tuple_list_and_namedtuple_types():
    parts = split((rows(5), torch.arange(5)), 2)
    assert [type(p) for p in parts] == [tuple] * 3
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    parts = split([rows(5), torch.arange(5)], 3)
    assert [type(p) for p in parts] == [list] * 2
    assert parts[1][1].tolist() == [3, 4]
    parts = split(Pair(rows(5), torch.arange(5)), 3)
    assert [type(p) for p in parts] == [Pair] * 2
    assert parts[1].targets.tolist() == [3, 4] and parts[1].inputs.shape == (2, 3)


def test_split_keeps_batch_encoding():
    enc = BatchEncoding({"input_ids": rows(5), "attention_mask": torch.ones(5, 3, dtype=torch.long)})
    parts = split(enc, 2)
    assert [type(p) for p in parts] == [BatchEncoding] * 3
    assert parts[2].input_ids.tolist() == [[12, 13, 14]]       # attribute access still works
    assert parts[0]["attention_mask"].shape == (2, 3)


def test_split_nested():
    batch = {"a": (rows(4), {"b": torch.arange(4)})}
    parts = split(batch, 3)
    assert parts[1]["a"][1]["b"].tolist() == [3]
    assert slice_batch("leaf", 0, 1) == "leaf"


def test_split_refuses_disagreeing_batches():
    with pytest.raises(ValueError, match=re.escape("batch['y'] has 3")):
        split({"x": rows(4), "y": rows(3)}, 2)


# -- weights -----------------------------------------------------------------------------------

def test_weights_by_rows():
    batch = {"x": rows(10)}
    parts = split(batch, 4)
    assert weights(batch, parts) == [0.4, 0.4, 0.2]
    assert weights(batch, split(batch, 10)) == [1.0]


LABELS = torch.tensor([
    [1, 2, -100, -100],       # 2 tokens; 1 after the causal shift
    [-100, 5, 6, 7],          # 3; 3
    [8, -100, -100, -100],    # 1; 0
    [9, 9, 9, 9],             # 4; 3
])


class TokenModel(torch.nn.Module):
    """A tiny per-token model with its own loss; `shift` predicts the next token, as a causal LM does."""
    shift = False

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1)))


class NextTokenDecoder(TokenModel):
    """A causal LM by what its loss does; its class name does not say so."""
    shift = True


class TaggerForCausalLM(TokenModel):
    """Named like a causal LM, but its loss predicts every label in place (no shift)."""


def test_token_weights_of_a_token_level_loss():
    batch = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "labels": LABELS}
    count = token_counter(TaggerForCausalLM())
    assert count(batch) == 10
    assert weights(batch, split(batch, 2), count) == [5 / 10, 5 / 10]
    assert weights(batch, split(batch, 3), count) == [6 / 10, 4 / 10]
    assert weights(batch, split(batch, 1), count) == [2 / 10, 3 / 10, 1 / 10, 4 / 10]


@pytest.mark.parametrize("model", [NextTokenDecoder(), tiny_gpt2()], ids=["NextTokenDecoder", "GPT2LMHeadModel"])
def test_causal_lm_token_weights_skip_the_first_label(model):
    batch = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "labels": LABELS}
    count = token_counter(model)
    assert count(batch) == 7
    assert weights(batch, split(batch, 1), count) == [1 / 7, 3 / 7, 0 / 7, 3 / 7]
    assert weights(batch, split(batch, 3), count) == [4 / 7, 3 / 7]


@pytest.mark.parametrize("batch", [
    {"input_ids": rows(4), "labels": torch.arange(4)},                 # one label per row
    {"input_ids": rows(4), "labels": torch.rand(4, 3)},                # regression targets
    {"input_ids": rows(4)},                                            # no labels
    (rows(4), LABELS),                                                 # not a dict: labels unknown
])
def test_row_weights_when_the_loss_is_not_per_token(batch):
    count = token_counter(NextTokenDecoder())
    assert count(batch) is None
    assert weights(batch, split(batch, 3), count) == [0.75, 0.25]


def test_a_batch_without_label_tokens_is_refused():
    batch = {"input_ids": rows(2, 4), "labels": torch.full((2, 4), IGNORE_INDEX)}
    with pytest.raises(ValueError, match=re.escape("the batch has no label token to learn from (every label is -100)")):
        weights(batch, split(batch, 1), token_counter(TaggerForCausalLM()))
    one_token = {"input_ids": rows(2, 4), "labels": torch.tensor([[3, -100, -100, -100], [-100] * 4])}
    with pytest.raises(ValueError, match="no label token"):  # after the shift nothing is left
        weights(one_token, split(one_token, 1), token_counter(NextTokenDecoder()))


# -- the weighted micro-batch losses are the full-batch loss -------------------------------------

def weighted_loss(model, batch, micro, count_tokens):
    parts = split(batch, micro)
    return sum(w * model(**p).loss for w, p in zip(weights(batch, parts, count_tokens), parts))


def tiny_xlnet():
    torch.manual_seed(0)
    return XLNetLMHeadModel(XLNetConfig(d_model=32, n_layer=2, n_head=2, d_inner=37, vocab_size=100, dropout=0.0,
                                        bos_token_id=99, eos_token_id=99, pad_token_id=98))


def padded_tokens(rows=5, seq=8):
    batch = {"input_ids": torch.randint(0, 16, (rows, seq), generator=torch.Generator().manual_seed(3))}
    batch["labels"] = batch["input_ids"].clone()
    for r in range(rows):
        batch["labels"][r, seq - r:] = IGNORE_INDEX
    return batch


@pytest.mark.parametrize("make_model, make_batch", [
    (tiny_gpt2, lambda: gpt2_batch(rows=5, seq=8)),
    (tiny_bert, lambda: bert_batch(rows=5, seq=8)),
    (tiny_xlnet, lambda: gpt2_batch(rows=5, seq=8)),
    (NextTokenDecoder, padded_tokens),
    (TaggerForCausalLM, padded_tokens),
], ids=["gpt2", "bert", "xlnet", "NextTokenDecoder", "TaggerForCausalLM"])
def test_weighted_micro_batch_losses_equal_the_full_batch_loss(make_model, make_batch):
    # XLNetLMHeadModel and TaggerForCausalLM are named like causal LMs but do not shift their
    # labels; NextTokenDecoder shifts them without saying so in its name: the model's loss tells.
    model = make_model().eval()
    batch = make_batch()
    count = token_counter(model)
    with torch.no_grad():
        full = model(**batch).loss
        assert abs(float(weighted_loss(model, batch, 2, count)) - float(full)) <= 1e-6
        assert abs(float(weighted_loss(model, batch, 1, count)) - float(full)) <= 1e-6


@pytest.mark.parametrize("make_model, shifts", [
    (NextTokenDecoder, True), (TaggerForCausalLM, False), (tiny_gpt2, True), (tiny_xlnet, False)])
def test_the_model_says_whether_it_shifts_its_labels_once_leaving_it_as_it_was(make_model, shifts):
    from autofit.engine.token_loss import shifts_labels
    model = make_model().train()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append("hook"))  # the user's hooks see training only
    forward = model.forward
    model.forward = lambda **kw: calls.append(kw["labels"].shape) or forward(**kw)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    batch = padded_tokens() if make_model in (NextTokenDecoder, TaggerForCausalLM) else gpt2_batch(rows=5, seq=8)
    assert shifts_labels(model, batch) is shifts and shifts_labels(model, batch) is shifts
    assert calls == [torch.Size([1, 8])] * 3  # one row, three forwards, asked once
    assert model.training and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("make_model, why", [(NextTokenDecoder, "label tokens (not -100, shifted)"),
                                             (TaggerForCausalLM, "label tokens (not -100, unshifted)")])
def test_training_and_evaluation_weigh_by_the_tokens_the_model_counts(make_model, why):
    import autofit
    from autofit.gpu.device import CpuDevice
    from autofit.engine.token_loss import loss_weighting
    batch = padded_tokens()
    model = make_model()
    weighting = loss_weighting(model, batch, None, CpuDevice())
    assert weighting.why == why and weighting.count(batch) == (25 if make_model is NextTokenDecoder else 30)
    with torch.no_grad():
        full = float(model(**batch).loss)
    evaluated = autofit.evaluate(make_model(), [batch], batch_size=2)
    assert evaluated.weight == weighting.count(batch) and abs(evaluated.loss - full) <= 1e-6


class LabelBlind(TokenModel):
    def forward(self, input_ids, labels):
        return SimpleNamespace(loss=self.head(self.embed(input_ids)).mean())


def test_a_loss_that_does_not_follow_its_labels_counts_every_label():
    from autofit.engine.token_loss import shifts_labels
    assert shifts_labels(LabelBlind(), padded_tokens()) is False
    assert token_counter(LabelBlind())(padded_tokens()) == 8 + 7 + 6 + 5 + 4
    assert token_counter(torch.nn.Linear(2, 2))(padded_tokens()) == 30  # no such forward: not shifted


def test_the_causal_shift_matters_for_gpt2():
    # The check above can fail: counting GPT-2's first label (no shift) or weighting by rows is wrong.
    model = tiny_gpt2().eval()
    batch = gpt2_batch(rows=5, seq=8)
    with torch.no_grad():
        full = float(model(**batch).loss)
        unshifted = float(weighted_loss(model, batch, 2, token_counter(TaggerForCausalLM())))
        by_rows = float(weighted_loss(model, batch, 2, None))
    assert abs(unshifted - full) > 1e-4 and abs(by_rows - full) > 1e-4


# -- dataset_batches ---------------------------------------------------------------------------

def test_dataset_batches_in_order_with_a_shorter_last_batch():
    dataset = [{"x": torch.tensor([float(i)]), "y": i} for i in range(10)]
    batches = list(dataset_batches(dataset, 4))
    assert [b["y"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[2]["x"].tolist() == [[8.0], [9.0]]
    assert list(dataset_batches(dataset, 4))[0]["y"].tolist() == [0, 1, 2, 3]  # no shuffling


# -- per-row Python fields, numpy arrays, metadata ----------------------------------------------

import numpy as np  # noqa: E402

from autofit.engine.batches import per_row_fields, row_elements  # noqa: E402


def test_default_collate_text_fields_reach_micro_batches_with_their_rows():
    from torch.utils.data import default_collate
    samples = [{"input_ids": torch.arange(4) + i, "labels": torch.arange(4) + i, "ids": f"doc-{i}"}
               for i in range(16)]
    batch = default_collate(samples)
    assert isinstance(batch["ids"], list) and len(batch["ids"]) == 16
    parts = split(batch, 8)
    assert [p["ids"] for p in parts] == [[f"doc-{i}" for i in range(8)], [f"doc-{i}" for i in range(8, 16)]]
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [list(range(8)), list(range(8, 16))]


def test_per_row_lists_tuples_numpy_and_nested_dicts_split_with_the_rows():
    batch = {"x": rows(5), "names": ("a", "b", "c", "d", "e"), "ints": [10, 11, 12, 13, 14],
             "floats": [0.5, 1.5, 2.5, 3.5, 4.5], "np": np.arange(10).reshape(5, 2),
             "meta": {"source": ["s0", "s1", "s2", "s3", "s4"], "lang": "en"}}
    parts = split(batch, 2)
    assert [p["names"] for p in parts] == [("a", "b"), ("c", "d"), ("e",)]
    assert [p["ints"] for p in parts] == [[10, 11], [12, 13], [14]]
    assert [p["floats"] for p in parts] == [[0.5, 1.5], [2.5, 3.5], [4.5]]
    assert [p["np"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert [p["meta"]["source"] for p in parts] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert all(p["meta"]["lang"] == "en" for p in parts)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1]


def test_fields_that_are_not_per_row_go_whole_to_every_micro_batch():
    classes = ["neg", "pos", "neutral"]  # metadata of another length than the 4 rows
    batch = {"x": rows(4), "classes": classes, "temperature": 0.7, "task": "sst2", "empty": [],
             "nested": [["a", "b"], ["c"]]}  # a list of lists of another length: metadata
    for part in split(batch, 3):
        assert part["classes"] is classes and part["temperature"] == 0.7 and part["task"] == "sst2"
        assert part["empty"] == [] and part["nested"] == [["a", "b"], ["c"]]


def test_per_sample_lists_collated_into_columns_are_split_per_column():
    from torch.utils.data import default_collate
    samples = [{"x": torch.tensor([i]), "tags": [f"t{i}", f"u{i}", f"v{i}"]} for i in range(4)]
    batch = default_collate(samples)  # tags: 3 columns of 4 strings
    parts = split(batch, 2)
    assert parts[1]["tags"] == [("t2", "t3"), ("u2", "u3"), ("v2", "v3")]
    # one list per row of another length than the rows: split as rows
    batch = {"x": rows(4), "spans": [[1, 2], [3], [], [4, 5, 6]]}
    assert [p["spans"] for p in split(batch, 2)] == [[[1, 2], [3]], [[], [4, 5, 6]]]


def test_an_ambiguous_field_is_refused_with_its_name():
    batch = {"x": rows(2), "pairs": [[1, 2], [3, 4]]}  # 2 rows of 2, or 2 columns of 2 rows?
    with pytest.raises(ValueError, match=re.escape(
            "batch['pairs'] is ambiguous: a list of 2 lists of 2 values each could be one list per row or "
            "2 per-row columns")):
        split(batch, 1)
    with pytest.raises(ValueError, match=re.escape("batch['pairs'] is ambiguous")):
        list(per_row_fields(batch))
    assert split({"x": rows(2), "pairs": np.array([[1, 2], [3, 4]])}, 1)[1]["pairs"].tolist() == [[3, 4]]


def test_batch_size_row_elements_weights_agree_on_per_row_fields():
    batch = {"x": rows(4), "np": np.zeros((4, 5)), "ids": ["a", "b", "c", "d"], "meta": ["m"] * 3}
    assert rows_of(batch) == 4
    assert row_elements(batch) == 3 + 5  # tensors and numpy arrays; Python lists hold no device memory
    assert [p for p, _ in per_row_fields(batch)] == ["batch['x']", "batch['np']", "batch['ids']"]
    parts = split(batch, 3)
    assert weights(batch, parts) == [0.75, 0.25]
    with pytest.raises(ValueError, match=re.escape("batch['x'] has 4, batch['np'] has 3")):
        rows_of({"x": rows(4), "np": np.zeros((3, 5))})
    with pytest.raises(ValueError, match=re.escape("batch['s'] is a 0-dimensional numpy array")):
        rows_of({"x": rows(4), "s": np.array(1.0)})
