"""Plan: how one global batch is executed on the device. An immutable value."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autofit.plans import precision as precisions
from autofit.plans.precision import EXACT
from autofit.plans import switches


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int but got {value!r}.")


@dataclass(frozen=True)
class Plan:
    """How a global batch runs: split into micro-batches, precision, checkpointing, offload.

    `per_parameter_step`: the optimizer updates one parameter at a time (its param_groups'
    `foreach=False` while the plan runs), so the step's temporaries are one parameter's, not all
    of them at once (foreach AdamW needs a parameter-sized temporary across every parameter).

    FSDP2 (a model sharded with `fully_shard`; on any other model these stay at their defaults,
    autofit.plans.applies): `reshard_after_forward` (None: as the model was sharded; False: each
    unit's gathered parameters are kept from forward to backward, one all-gather fewer per unit and
    micro-batch; True: freed after forward and gathered again in backward) and
    `reduce_each_micro_batch` (a reduce-scatter after every micro-batch into the sharded gradients,
    instead of gradient sync off until the last micro-batch, which keeps every unit's unsharded
    gradients until then).

    `accumulation_steps` is derived from the global batch when a plan is made by `Plan.for_batch`;
    a batch shorter than `micro_batch_size * accumulation_steps` (the last one of an epoch) is split
    by `micro_batch_size` and its last micro-batch may be shorter.
    """

    micro_batch_size: int
    accumulation_steps: int = 1
    precision: str = EXACT
    checkpointing: bool = False
    offload_optimizer: bool = False
    per_parameter_step: bool = False  # a default, so plans cached before it stay valid
    reshard_after_forward: bool | None = None  # FSDP2 only; defaults keep cached plans valid
    reduce_each_micro_batch: bool = False      # FSDP2 only

    def __post_init__(self):
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("accumulation_steps", self.accumulation_steps)
        precisions.get(self.precision)  # raises naming the value and the choices
        if not isinstance(self.reduce_each_micro_batch, bool):
            raise TypeError(f"reduce_each_micro_batch must be True or False but got "
                            f"{self.reduce_each_micro_batch!r}.")
        if not isinstance(self.reshard_after_forward, (bool, type(None))):
            raise TypeError(f"reshard_after_forward must be True, False or None (as the model was "
                            f"sharded) but got {self.reshard_after_forward!r}.")

    @classmethod
    def for_batch(cls, global_batch: int, micro_batch_size: int | None = None, **fields: object) -> "Plan":
        """A plan whose micro-batches cover `global_batch` samples (micro-batch capped at it)."""
        _positive("global_batch", global_batch)
        if micro_batch_size is not None:
            _positive("micro_batch_size", micro_batch_size)
        micro = min(micro_batch_size or global_batch, global_batch)
        return cls(micro_batch_size=micro, accumulation_steps=math.ceil(global_batch / micro), **fields)

    @property
    def global_batch(self) -> int:
        """The largest global batch this plan covers."""
        return self.micro_batch_size * self.accumulation_steps

    def replace(self, **fields: object) -> "Plan":
        return dataclasses.replace(self, **fields)

    def with_micro_batch(self, micro_batch_size: int, global_batch: int) -> "Plan":
        _positive("micro_batch_size", micro_batch_size)
        _positive("global_batch", global_batch)
        micro = min(micro_batch_size, global_batch)
        return self.replace(micro_batch_size=micro, accumulation_steps=math.ceil(global_batch / micro))

    def plain(self) -> "Plan":
        """This plan with nothing a step-down turns on: the exact precision and every switch off but
        FSDP2's (they follow how the model was sharded: `sharded_only` in plans/switches.py)."""
        return self.replace(precision=EXACT, **{s.name: False for s in switches.SWITCHES if not s.sharded_only})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Plan fields {sorted(unknown)}; expected {sorted(names)}.")
        return cls(**data)

    def describe(self) -> str:
        parts = [f"micro {self.micro_batch_size} x {self.accumulation_steps}", self.precision]
        parts += [w for s in switches.SWITCHES if (w := s.label(getattr(self, s.name))) is not None]
        return ", ".join(parts)
