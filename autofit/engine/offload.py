"""Optimizer-state offload: the user's optimizer keeps its state in host memory and steps there.

Decision: the step runs on the host, on the optimizer's own state tensors, with exactly one call of
the user's `optimizer.step()`. Between steps every tensor of `optimizer.state` lives in host memory.
For the step, each parameter held on the device is staged: its values and gradient are copied into
host buffers (pinned on CUDA, kept from one step to the next) and the parameter's `data` and `grad`
are swapped to them, so the same Parameter objects (the keys of `optimizer.state`, the entries of
`param_groups`) are stepped on the host. Afterwards each device tensor is written back in place and
the swap undone.

Why this design over the alternatives:
- the optimizer object, its param_groups, its hooks, a scheduler's wrapper around its `step` and its
  `state_dict()` stay the user's: nothing is copied or rebuilt, so `state_dict()`/`load_state_dict()`,
  `add_param_group`, every scheduler and `torch.save` act as in a plain loop;
- one `optimizer.step()` per global batch: bringing the state to the device one parameter at a time
  would call the user's step (its hooks, counters and the scheduler's wrapper) once per parameter;
  bringing all of it to the device for the step would need all of it on the device at once;
- the device allocates nothing for the update: the device peak of an offloaded step is the
  parameters, gradients and activations; the state and the update's temporaries are host memory;
- the parameters are read from the device at every step, so the user's own writes between steps
  (`p.clamp_`, `model.load_state_dict(earlier)`) are what is stepped.
Cost: per step, each staged parameter moves three times its size (values and gradient to the host,
values back; `bytes_moved`), and the update runs at host speed.

Consistency: the device parameters are untouched until the write-back; a failure before it (an OOM,
a KeyboardInterrupt) leaves them as they were, and the atomic step restores the host state from its
snapshot (`atomic.Snapshot(params=False)`). Once the host update is done it is applied: Ctrl-C is
held from then until every parameter is written back and the swaps undone (`interrupts.SigintHold`;
an error a write-back copy raises is held too, `interrupted`), then raised by the runner after the
step, with parameters and state both after the update and the parameters on the device.

Where the state is: on the host from the first offloaded step (and right after a `load_state_dict`,
which torch places on the parameters' device) until a plan without offload takes it back to the
device (`to_device`); after the run it stays where the last plan kept it, except for an optimizer
autofit built from a factory, whose state goes to the host at the end (`to_host`): the device is
then as clean as before the run, as a second training phase needs, and `RunResult.optimizer` still
holds the state to save. Group options a host step
cannot run with (`capturable`) are off during the host step only.
"""

from __future__ import annotations

import inspect

import torch

from autofit.engine import interrupts, optimizer_state
from autofit.errors import PartialUpdateError
from autofit.gpu.device import _map_tensors
from autofit.gpu.oom import is_oom

_HOST_OFF = ("capturable",)  # group options that need device tensors: off while the host steps


def params_of(optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order, each once."""
    seen, out = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class Offload:
    """The user's optimizer with its state on the host; `step(run)` stages the parameters and calls
    `run()` (which calls `optimizer.step()` once) with them on the host."""

    def __init__(self, optimizer: torch.optim.Optimizer, device):
        self.optimizer, self.device = optimizer, device
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(p) -> (values, grad)
        self.interrupted: BaseException | None = None  # held during the write-back, raised after it
        self.sigint = interrupts.SigintHold()  # Ctrl-C held from the host update to the write-back's end
        self.bytes_moved = 0  # host <-> device bytes of the last step
        # load_state_dict places the state on the parameters' device: take it back to the host.
        self._hook = optimizer.register_load_state_dict_post_hook(lambda opt: self.to_host())
        self.to_host()

    # -- where the state lives ------------------------------------------------------------------
    def to_host(self) -> None:
        """Replace every state tensor held on the device by a host copy."""
        to_host(self.optimizer, self.device)

    def close(self) -> None:
        """Stop offloading; the state stays on the host (`to_device` brings it back)."""
        self._hook.remove()
        self.buffers.clear()

    # -- one step -------------------------------------------------------------------------------
    def step(self, run) -> None:
        """Stage the parameters on the host, `run()`, write them back (see the module's docstring)."""
        self.to_host()  # state a user put back on the device some other way
        self.interrupted = None
        self.bytes_moved = 0
        staged = []  # (param, its device data, its device grad)
        options = []
        applied = False
        with self.sigint:
            try:
                with torch.no_grad(), self.device.host():
                    for p in params_of(self.optimizer):
                        if self.device.on_device(p):
                            staged.append((p, p.data, p.grad))  # before the swap: undone whatever happens
                            self._stage(p)
                for group in self.optimizer.param_groups:
                    options.append({k: group[k] for k in _HOST_OFF if k in group})
                    group.update({k: False for k in options[-1]})
                with self.device.host():
                    run()
                # The update is done on the host: from here Ctrl-C is held until it is written
                # back (one arriving before this line leaves it unapplied, the snapshot restores).
                self.sigint.hold()
                applied = True
            finally:
                self._finish(staged, options, write=applied)

    def _stage(self, p) -> None:
        values, grad = self._buffer(p)
        data, device_grad = p.data, p.grad
        values.copy_(data)
        moved = values.nbytes * 2  # there and back
        if device_grad is not None:
            if device_grad.is_sparse or grad is None:
                grad = device_grad.detach().to("cpu", copy=True)
            else:
                grad.copy_(device_grad)
            moved += device_grad.nbytes if not device_grad.is_sparse else 0
        p.grad = None  # the swap: data and grad must be on one device at every moment
        p.data = values
        p.grad = grad if device_grad is not None else None
        self.bytes_moved += moved

    def _buffer(self, p) -> tuple:
        """Host buffers like `p` and its gradient, made once and reused while their shape holds."""
        kept = self.buffers.get(id(p))
        grad = p.grad
        dense = grad is not None and not grad.is_sparse
        if kept is None or kept[0].shape != p.shape or kept[0].dtype != p.dtype or \
                (dense and (kept[1] is None or kept[1].shape != grad.shape or kept[1].dtype != grad.dtype)):
            kept = (self.device.host_empty(p), self.device.host_empty(grad) if dense else None)
            self.buffers[id(p)] = kept
        return kept

    def _finish(self, staged, options, write: bool) -> None:
        """Put the group options back and undo the swaps; with `write` (the update is applied),
        first copy each staged parameter back in place. A copy that raises is made again (an
        in-place copy cannot run out of memory); one that fails twice stops the run with
        PartialUpdateError once every swap is undone."""
        for group, kept in zip(self.optimizer.param_groups, options):
            group.update(kept)
        failed = None
        for p, data, grad in staged:
            if write and failed is None:
                failed = self._copy_back(data, p)
            p.grad = None
            p.data = data
            p.grad = grad
        if failed is not None:
            raise PartialUpdateError(
                f"the offloaded update could not be written back to the device ({failed!r}); some "
                f"parameters hold it and some do not, so the run stops here.") from failed

    def _copy_back(self, data, p) -> BaseException | None:
        """Copy the host update into the device tensor, once more if the first copy raised (an
        error other than OOM is held and raised after the step); the second copy's error, or None."""
        try:
            data.copy_(p.data)
            return None
        except BaseException as error:
            if not is_oom(error):
                self.interrupted = self.interrupted or error
        try:
            data.copy_(p.data)
        except BaseException as again:
            return again
        return None

    def raise_interrupted(self) -> None:
        """Raise an interrupt held during the last write-back (the update is applied): a Ctrl-C
        (`interrupts.SigintHold`), or an error a first copy raised."""
        self.sigint.deliver()
        error, self.interrupted = self.interrupted, None
        if error is not None:
            raise error


def to_host(optimizer, device) -> None:
    """Replace every state tensor held on the device by a host copy: those of every optimizer it
    wraps too, and those inside lists, tuples and dicts (`optimizer_state`)."""
    on_device = device.on_device
    with torch.no_grad(), device.host():
        optimizer_state.map_state(
            optimizer, lambda v: v.detach().to("cpu", copy=True) if on_device(v) else v)


def to_device(optimizer, device) -> None:
    """Bring host state back next to device parameters, as torch's load_state_dict places it:
    `step` counters stay on the host unless the group is capturable or fused."""
    with torch.no_grad():
        for holder in optimizer_state.holders(optimizer):
            for group in holder.param_groups:
                device_step = bool(group.get("capturable") or group.get("fused"))
                for p in group["params"]:
                    state = holder.state.get(p)
                    if not state or not device.on_device(p):
                        continue
                    for k, v in list(state.items()):
                        if k == "step" and not device_step:
                            continue
                        if isinstance(v, torch.Tensor):
                            if not device.on_device(v):
                                state[k] = device.to_device(v)
                        elif optimizer_state.tensors(v):
                            state[k] = _map_tensors(v, lambda t: t if device.on_device(t) else device.to_device(t))


def offload_problem(optimizer) -> str | None:
    """Why this optimizer cannot be stepped offloaded, or None: its step must run without a closure."""
    cls = type(optimizer)
    name = cls.__name__
    try:
        step = inspect.signature(cls.step)
    except (TypeError, ValueError):
        return f"{name}.step cannot be read"
    closure = step.parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return f"{name}.step needs a closure"
    return None


def offload_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """Optimizer offload's `applies` (plans/switches.py): see offload_problem."""
    if plan.offload_optimizer:
        problem = offload_problem(optimizer)
        if problem:
            return f"optimizer offload does not apply: {problem}"
    return None
