"""Two steppers in one loop (a GAN's discriminator and generator): gradients one stepper's backward
leaves on the other's parameters.

A stepper keeps the gradients present when its step begins (a user's own accumulation). In a GAN
the generator's loss runs through the discriminator, so its backward leaves gradients on the
discriminator's parameters; DCGAN's loop clears them with `netD.zero_grad()` before the
discriminator's step, and a loop converted by replacing only `optimizer.zero_grad()` would train the
discriminator on them. A stepper that begins with gradients on its parameters after another
stepper has stepped says so once, with the fix. One stepper alone pays nothing: the parameters are
looked at only when another stepper stepped in between.
"""

from __future__ import annotations

import logging

log = logging.getLogger("autofit")

_STEPS = [0]  # steps taken by every stepper of this process


class Crossing:
    def __init__(self, model):
        self.model = model
        self.last = None  # _STEPS after this stepper's last step
        self.said = False

    def before(self) -> None:
        if self.said or self.last is None or self.last == _STEPS[0]:
            return
        carried = sum(1 for p in self.model.parameters() if p.requires_grad and p.grad is not None)
        if not carried:
            return
        self.said = True
        name = type(self.model).__name__
        log.warning("%d parameter(s) of %s have gradients that another stepper's backward left since this "
                    "stepper's last step (a GAN's generator loss reaches the discriminator); a step adds the "
                    "gradients present when it begins, so they would train it too. A plain loop clears them "
                    "first: call zero_grad(set_to_none=True) on this stepper's model (%s) before step(batch), "
                    "as DCGAN's loop calls netD.zero_grad().", carried, name, name)

    def after(self) -> None:
        _STEPS[0] += 1
        self.last = _STEPS[0]
