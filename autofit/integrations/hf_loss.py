"""The Trainer's loss under gradient accumulation: make every split of the effective batch train on
the same gradient, also for heads that ignore `num_items_in_batch` (huggingface/transformers#47688)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autofit.integrations.hf_trainer import trainer_class, sample_batch


def fix_loss_scaling(trainer, device) -> str | None:
    """Make the Trainer divide the loss by the accumulation steps when the model ignores
    `num_items_in_batch` although its forward takes **kwargs; the reason, or None when nothing
    was changed.

    The Trainer skips that division for models whose forward takes **kwargs, trusting them to
    normalise by `num_items_in_batch`; heads that drop it (BERT's sequence classification, among
    others: huggingface/transformers#47688) then train on a gradient `gradient_accumulation_steps`
    times too large, and a step-down that changes the accumulation would change the mathematics. A
    forward of two rows with two different counts tells which kind the model is.
    """
    if not getattr(trainer, "model_accepts_loss_kwargs", False) or trainer.compute_loss_func is not None \
            or getattr(trainer, "loss_is_scaled_for_ga", None) is not None \
            or type(trainer).compute_loss is not trainer_class().compute_loss:
        return None
    batch = sample_batch(trainer, 2)
    if not isinstance(batch, Mapping) or "labels" not in batch:
        return None
    model = trainer.model
    target = next(model.parameters()).device
    batch = {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), device.host():
            losses = [getattr(model(**batch, num_items_in_batch=torch.tensor(n, device=target)), "loss", None)
                      for n in (1.0, 2.0)]
    except TypeError:  # the forward refuses the keyword: the Trainer's own call would fail too
        return None
    finally:
        model.train(was_training)
    if any(loss is None for loss in losses) or not torch.allclose(losses[0], losses[1]):
        return None
    trainer.model_accepts_loss_kwargs = False
    return (f"{type(model).__name__}'s loss ignores num_items_in_batch although its forward takes "
            f"**kwargs: the Trainer now divides it by gradient_accumulation_steps, so every split of "
            f"the effective batch trains on the same gradient (huggingface/transformers#47688)")
