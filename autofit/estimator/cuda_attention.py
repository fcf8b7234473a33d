"""Scaled dot-product attention as a CUDA card runs it, for the estimator's fake tensors.

On CPU, SDPA takes the math path in training (attention dropout) and keeps the T x T attention
matrix; a card runs flash attention (fp16/bf16 without a mask) or memory-efficient attention, O(T)
memory. `attention_as_on_cuda(mode)` routes SDPA on one fake mode's tensors to those kernels.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

import torch
import torch.nn.functional as F

from autofit import torch_internals as ti
from autofit.plans import precision as precisions

class FunctionalPatch:
    """A `torch.nn.functional` function replaced while at least one estimate needs it.

    `patch(mode)` is a context: the first estimate in replaces the function (and runs `on_first`),
    the last one out puts the original back (after `on_last`). `modes` holds the fake modes inside,
    which the replacement reads to know whose tensors it handles; `original` is what it calls for
    every other tensor.
    """

    def __init__(self, name: str, replacement, on_first=None, on_last=None):
        self.name, self.replacement = name, replacement
        self.on_first, self.on_last = on_first, on_last
        self.lock = threading.Lock()
        self.users, self.original, self.modes = 0, None, weakref.WeakSet()

    @contextlib.contextmanager
    def patch(self, mode):
        with self.lock:
            if self.users == 0:
                if self.on_first is not None:
                    self.on_first()
                self.original = getattr(F, self.name)
                setattr(F, self.name, self.replacement)
            self.users += 1
            self.modes.add(mode)
        try:
            yield
        finally:
            with self.lock:
                self.modes.discard(mode)
                self.users -= 1
                if self.users == 0:
                    setattr(F, self.name, self.original)
                    self.original = None
                    if self.on_last is not None:
                        self.on_last()


def _routed_attention(query, key, value, *args, **kwargs):
    mode = getattr(query, "fake_mode", None)
    if mode is not None and mode in _routing.modes:
        return cuda_attention(query, key, value, *args, **kwargs)
    return _routing.original(query, key, value, *args, **kwargs)


_routing = FunctionalPatch("scaled_dot_product_attention", _routed_attention)


@contextlib.contextmanager
def attention_as_on_cuda(mode):  # a FakeTensorMode
    """While inside, SDPA on this fake mode's tensors runs CUDA's kernels; every other call is untouched.

    A function mode cannot do this: the autograd engine does not carry function modes into backward,
    where checkpointing recomputes the forward, and a recomputation that took another path than the
    forward is an error. So `F.scaled_dot_product_attention` itself is wrapped while any estimate
    needs it; the wrapper routes only fake tensors of an estimate's own mode, so other threads and
    real tensors go to the original.
    """
    with _routing.patch(mode):
        yield


def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """Scaled dot-product attention through flash / memory-efficient attention's (fake) kernels."""
    if torch.is_autocast_enabled(query.device.type):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    with torch.autocast(query.device.type, enabled=False):
        if key.size(-3) != query.size(-3):  # grouped-query attention
            repeat = query.size(-3) // key.size(-3)
            key = key.repeat_interleave(repeat, dim=-3)
            value = value.repeat_interleave(repeat, dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device
                                    ).masked_fill_(attn_mask.logical_not(), -math.inf)
        low = query.dtype in precisions.autocast_dtypes()  # flash attention runs only in these
        if low and attn_mask is None and query.size(-1) <= 256:
            return ti.flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask is not None:
            attn_mask = attn_mask.expand(query.size(0), query.size(-3), query.size(-2), key.size(-2))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return ti.efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]
