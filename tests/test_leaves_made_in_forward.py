"""A leaf a forward makes with requires_grad (T5 makes its cross-attention bias so under
checkpointing) is the attempt's own: after a failed attempt nothing of autofit's holds it, and
the replay ends exactly as a run without the failure."""

import torch

import autofit
from autofit.gpu.simulate import active_gpu


class BiasMadeInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        bias = torch.zeros(x.shape[0], 8, device=x.device)
        bias.requires_grad = True  # a leaf outside the model that the loss reaches
        return self.out(torch.relu(self.lin(x) + bias))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _run(fault_in_backward_of_step=None):
    model = BiasMadeInForward()
    backwards = [0]

    def hook(module, grad_input, grad_output):
        backwards[0] += 1
        if backwards[0] == fault_in_backward_of_step:
            gpu = active_gpu()
            gpu.fail_at(gpu.allocation_count + 1)
    model.out.register_full_backward_hook(hook)
    result = autofit.run(model, _batches(), loss_fn=_loss, budget="64MiB", capacity_check=False,
                         progress=False, precision="fp32", cache=False)
    return model, result


def test_a_failed_attempt_leaves_no_leaf_its_forward_made_held():
    clean, _ = _run()
    model, result = _run(fault_in_backward_of_step=3)  # step 2's backward: a size proven by then
    assert [(a.step, a.outcome) for a in result.attempts] == [(0, "ok"), (1, "ok"), (2, "oom"), (2, "ok"), (3, "ok")]
    assert result.attempts[3].reason.startswith("retry: this micro-batch trained rows this long before")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), clean.state_dict().values()))
