"""FSDP2: the block finder and sharded-model detection (here), and 2 gloo ranks training a
fully_shard model in lockstep (the spawned scenario below)."""

from __future__ import annotations

import pytest
import torch

from autofit.distributed.fsdp import block_classes, blocks, is_sharded, shard


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([_Block(), _Block(), _Block()])
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 2), torch.nn.Bilinear(4, 4, 1)])


def test_hugging_face_blocks_come_from_no_split_modules():
    from reference import bert, gpt2
    model = bert(layers=2)
    assert {c.__name__ for c in block_classes(model)} == {"BertEmbeddings", "BertLayer"}
    found = blocks(model)
    assert [n for n, m in model.named_modules() if any(m is b for b in found)] == \
        ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert [type(b).__name__ for b in blocks(gpt2(layers=2))] == ["GPT2Block", "GPT2Block"]


def test_without_no_split_modules_the_repeated_children_of_a_module_list_are_the_blocks():
    model = _Stack()
    # The heads ModuleList mixes classes: not blocks; nor is the Linear outside any list.
    assert block_classes(model) == {_Block}
    names = [n for n, m in model.named_modules() if any(m is b for b in blocks(model))]
    assert names == ["layers.0", "layers.1", "layers.2"]


def test_a_model_without_blocks_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="shard=True found no transformer blocks in Sequential"):
        shard(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))


def test_plain_parameters_are_not_sharded():
    assert not is_sharded(_Stack())
    assert not is_sharded(object())
