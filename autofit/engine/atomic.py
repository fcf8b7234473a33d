"""An optimizer step that is applied whole or not at all.

Optimizers mutate in place before they allocate: foreach AdamW increments `step`, decays the
parameters and updates `exp_avg` before `_foreach_sqrt` allocates. An OOM there leaves a half-applied
update, and replaying the global batch on top of it would apply part of the update twice.

When a step can fail (a fault is armed, or the free memory is not known to exceed what the last step
of this plan needed), the parameters and the optimizer state are copied to host memory first and
copied back in place if the step runs out of memory. A step known to fit runs without the copy, so
a steady run pays nothing. A fast-path step that fails anyway cannot be undone; it is reported as
`PartialUpdateError` instead of being retried on top of itself.

What a failed step wrote is judged by value against its snapshot. Write counters cannot judge it:
the foreach kernels torch's optimizers use by default have no ADInplaceOrView kernel, so their
in-place writes move `_version` only through the CPU's per-tensor fallback: not under a dispatch
mode (a simulated GPU, a profiler's), and by the same dispatch table not on CUDA's multi-tensor
kernels. A step without a snapshot is judged by where it failed, which the caller watches (it sets
`began` False before the step and its step pre-hook sets it True as the optimizer's own update
starts, after every other pre-hook): an OOM before that, in a step pre-hook or the grad scaler's
unscaling, came before the optimizer wrote any parameter or state, and is an OOM like any other (a
pre-hook that itself writes parameters and then runs out of memory is not told apart: its writes
would be made again by the replay). One after it may have written anything, and stops the run.

A guarded step that fails with anything else (a KeyboardInterrupt, an error in a step hook) is
rolled back as well, and the error propagates as raised. A step without a snapshot holds Ctrl-C
until it ends (`interrupts.SigintHold`), then raises it: parameters and state both after the update. An offloaded step (offload.py) is always
guarded, by a snapshot of the state alone: it writes the device parameters only once its update is
done, and its host copies are written again at every step instead of allocated.

Sharded parameters and state (FSDP2's DTensors) are copied and restored through their local
shards: each rank saves and restores its own shard, and no copy communicates.
"""

from __future__ import annotations

import weakref

import torch

from autofit.engine import interrupts, optimizer_state
from autofit.errors import PartialUpdateError
from autofit.gpu.oom import is_oom, summarize
from autofit.engine.replay import restore_groups, save_groups

HEADROOM = 1.25       # margin over the last measured need of a step
HEADROOM_BYTES = 1 << 20


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Snapshot:
    """Host copies of the parameters, optimizer state and param_groups an optimizer step may mutate
    (the state of every optimizer it wraps, at any depth: `optimizer_state.Copy`). `params=False`:
    the parameters are left out (an offloaded step writes them only once it is applied, see
    offload.py); the state is still restored for every parameter. `spare`: the host copies of an
    earlier snapshot that nothing else holds, written again instead of allocated."""

    def __init__(self, optimizer, device, params: bool = True, spare: dict | None = None):
        self.optimizer = optimizer
        with torch.no_grad(), device.host():
            self.params = [(p, optimizer_state.host_copy(p) if params else None) for p in _params(optimizer)]
            self.state = optimizer_state.Copy(optimizer, spare)
            # some optimizers count steps in the group; a wrapper may keep groups of its own
            self.groups = [(opt, save_groups(opt)) for opt in optimizer_state.group_owners(optimizer)]

    def spare(self) -> dict:
        """The state's host copies for the next snapshot, once this one is not needed (a restore
        may hand these copies to the optimizer: never after one)."""
        return self.state.spare()

    def unchanged(self) -> bool:
        """Whether the parameters and state hold what was copied: a step that wrote nothing (an
        OOM in a step pre-hook, or at its first temporary). By value: in-place foreach ops under a
        dispatch mode (a simulated GPU, a profiler) bump no write counter."""
        with torch.no_grad():
            if any(saved is not None and not torch.equal(optimizer_state.local(p).detach().cpu(), saved)
                   for p, saved in self.params):
                return False
            return self.state.unchanged()

    def restore(self) -> None:
        """Copy everything back in place; state made by the failed step is dropped."""
        for opt, groups in self.groups:
            restore_groups(opt, groups)
        with torch.no_grad():
            for p, saved in self.params:
                if saved is not None:
                    optimizer_state.local(p).copy_(saved)
        self.state.restore()


def _optimizer_name(optimizer) -> str:
    name = type(optimizer).__name__
    return name + (" (foreach off)" if any(g.get("foreach") is False for g in optimizer.param_groups) else "")


class AtomicStep:
    """Runs `step_fn` (which calls optimizer.step) so that an OOM leaves no partial update."""

    def __init__(self, optimizer, device):
        self.optimizer, self.device = optimizer, device
        self.need: dict = {}  # plan config -> bytes the step needed above what was allocated before it
        self.snapshots = 0    # how many steps were guarded (for reports and tests)
        self.outer_peak = 0   # the device peak just before the last step (its counter is reset)
        self.failed_at = None  # bytes allocated when the last step ran out of memory
        self._spare = None     # the last state-only snapshot's copies, reused by the next one
        self.untouched = False  # the last step ran out of memory before it wrote anything
        # Whether the optimizer's own update had started: a caller that watches sets False before
        # each step and its step pre-hook True (see the module docstring); None: nobody watches.
        self.began: bool | None = None
        self.sigint = interrupts.SigintHold()  # installed at the first unguarded step, until close()
        weakref.finalize(self, self.sigint.uninstall)  # an AtomicStep dropped without close()

    def close(self) -> None:
        """The SIGINT handler from before the first step back (the run is over)."""
        self.sigint.uninstall()

    def _applied(self) -> str:
        """What the failed unguarded step may have applied, as far as it can be told."""
        if self.began:
            return (f"{_optimizer_name(self.optimizer)}'s own update had started, so any of its "
                    f"parameters and state may hold it in part")
        return "its update may have been applied in part"

    def at_risk(self, key) -> bool:
        if self.device.fault_armed:
            return True
        free = self.device.free_bytes()
        if free is None:
            return False
        need = self.need.get(key)
        return need is None or free < need * HEADROOM + HEADROOM_BYTES

    def __call__(self, step_fn, key=None, guard: bool | None = None, params: bool = True) -> None:
        """`params=False`: the snapshot leaves the parameters out (an offloaded step, guarded at
        every step: its host copies are kept and written again by the next one)."""
        guard = self.at_risk(key) if guard is None else guard
        spare, self._spare = self._spare, None
        snapshot = Snapshot(self.optimizer, self.device, params, spare if not params else None) \
            if guard else None
        del spare
        if snapshot is not None:
            self.snapshots += 1
        before = self.device.memory_allocated()
        self.untouched = False
        self.outer_peak = self.device.max_memory_allocated()
        self.device.reset_peak_memory_stats()
        failure = None
        # Without a snapshot nothing can undo a half-applied update: Ctrl-C waits for its end.
        sigint = self.sigint if snapshot is None else None
        try:
            if sigint is None:
                step_fn()
            else:
                sigint.install()  # once per run: in place from then on
                sigint.hold()
                try:
                    step_fn()
                finally:
                    sigint.release()
        except BaseException as error:
            if not is_oom(error):
                if snapshot is not None:  # an interrupt or another error: propagates, rolled back
                    snapshot.restore()
                raise
            failure = summarize(error)
            self.failed_at = self.device.memory_allocated()
            # Judged by what was written (by value, against the snapshot); without one, by whether
            # the optimizer's own update had started.
            self.untouched = snapshot.unchanged() if snapshot is not None else self.began is False
        step_peak = self.device.max_memory_allocated()
        if failure is None:
            self.need[key] = max(step_peak - before, 0)
            if snapshot is not None and not params:
                self._spare = snapshot.spare()
            if sigint is not None:
                sigint.deliver()  # the update is whole: the Ctrl-C held during it is raised now
            return
        # Out of the except block: the failed step's frames and temporaries are gone.
        if self.untouched:  # nothing to undo: an out-of-memory like any other, which a replay may survive
            if snapshot is not None:
                snapshot.restore()  # (group entries a pre-hook may have set)
            raise torch.OutOfMemoryError(f"{failure} (in optimizer.step, before it wrote anything)")
        if snapshot is None:
            raise PartialUpdateError(
                f"the optimizer step ran out of memory part-way ({failure}) although the last step "
                f"of this plan fitted with room to spare; {self._applied()}, and it cannot be undone, "
                f"so the run stops here instead of applying it twice. Lower the budget or set "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation.")
        snapshot.restore()
        del snapshot
        raise torch.OutOfMemoryError(f"{failure} (in optimizer.step; update rolled back)")

