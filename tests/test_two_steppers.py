"""A GAN converted to two steppers (autofit/recipes/crossing.py)."""

import logging

import torch
import torch.nn.functional as F
from torch import nn

import autofit


def nets(seed=0):
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return generator, discriminator


def batches(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [{"real": torch.randn(rows, 8, generator=g), "z": torch.randn(rows, 4, generator=g)} for _ in range(n)]


def d_loss(G, D):
    def loss(model, batch):
        real, fake = model(batch["real"]), model(G(batch["z"]).detach())
        return (F.binary_cross_entropy_with_logits(real, torch.ones_like(real))
                + F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake)))
    return loss


def g_loss(G, D):
    def loss(model, batch):
        out = D(model(batch["z"]))
        return F.binary_cross_entropy_with_logits(out, torch.ones_like(out))
    return loss


def adam(params):
    return torch.optim.Adam(params, lr=2e-3, betas=(0.5, 0.999))


def dcgan_loop(data):
    G, D = nets()
    opt_d, opt_g = adam(D.parameters()), adam(G.parameters())
    for batch in data:
        D.zero_grad()
        d_loss(G, D)(D, batch).backward()
        opt_d.step()
        G.zero_grad()
        g_loss(G, D)(G, batch).backward()
        opt_g.step()
    return G, D


def converted(data, clear_d):
    G, D = nets()
    with autofit.stepper(D, adam, loss_fn=d_loss(G, D), precision="fp32", cache=False) as step_d, \
            autofit.stepper(G, adam, loss_fn=g_loss(G, D), precision="fp32", cache=False) as step_g:
        for batch in data:
            if clear_d:
                D.zero_grad(set_to_none=True)
            step_d(batch)
            step_g(batch)
    return G, D


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_gan_converted_with_the_discriminators_zero_grad_ends_as_the_dcgan_loop(caplog):
    with caplog.at_level(logging.WARNING, logger="autofit"):
        G, D = converted(batches(), clear_d=True)
    G0, D0 = dcgan_loop(batches())
    assert same(G, G0) and same(D, D0)
    assert not [r for r in caplog.records if "another stepper" in r.getMessage()]


def test_a_gan_converted_without_it_is_told_once_with_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger="autofit"):
        G, D = converted(batches(), clear_d=False)
    said = [r.getMessage() for r in caplog.records if "another stepper" in r.getMessage()]
    assert said == [
        "4 parameter(s) of Sequential have gradients that another stepper's backward left since this stepper's "
        "last step (a GAN's generator loss reaches the discriminator); a step adds the gradients present when it "
        "begins, so they would train it too. A plain loop clears them first: call zero_grad(set_to_none=True) on "
        "this stepper's model (Sequential) before step(batch), as DCGAN's loop calls netD.zero_grad()."]
    assert not same(D, dcgan_loop(batches())[1])  # what the warning is about
