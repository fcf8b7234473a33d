"""The attempt loop's state is one value (docs/contributing.md, "The attempt loop"): each attempt of
a global batch is given a `Search`, and each failure returns the next one (a step down, an upward
probe's fallback) with the last out-of-memory attempt in it; nothing else carries the search."""

import autofit
from autofit.engine import controller as controller_module
from autofit.engine.controller import Search
from test_transient import _batches, _faults_at, _loss, _mlp


def test_each_attempt_is_given_the_search_the_failure_before_it_returned(monkeypatch):
    given = []
    attempt = controller_module.Controller._attempt

    def spy(self, search, **kwargs):
        given.append(search)
        return attempt(self, search, **kwargs)
    monkeypatch.setattr(controller_module.Controller, "_attempt", spy)
    model = _mlp()
    # forward calls: 1 the whole batch (OOM) and 2 its step down; 3 step 1's whole batch (OOM), 4-5
    # its two micro-batches; 6 the upward probe of step 2 (OOM), 7-8 the fallback's micro-batches
    _faults_at(model, {1, 3, 6})
    autofit.run(model, _batches(4, 8), loss_fn=_loss, budget="64MiB", capacity_check=False, progress=False,
                precision="fp32", cache=False)

    def shown(search: Search):
        return (search.plan.describe(), search.reason.split(" (")[0].split(":")[0],
                search.fallback and search.fallback.describe(), search.oom and search.oom[:2])
    ckpt8 = autofit.Plan(8, checkpointing=True)
    assert [shown(s) for s in given] == [
        ("micro 8 x 1, fp32", "start", None, None),
        ("micro 8 x 1, fp32, checkpointing", "activation checkpointing recomputes activations in backward",
         None, (autofit.Plan(8), "forward")),
        ("micro 8 x 1, fp32, checkpointing", "kept", None, None),
        ("micro 4 x 2, fp32, checkpointing", "smaller micro-batch, more accumulation", None, (ckpt8, "forward")),
        ("micro 6 x 2, fp32, checkpointing", "probe a larger micro-batch", "micro 4 x 2, fp32, checkpointing",
         None),
        ("micro 4 x 2, fp32, checkpointing", "back to the largest micro-batch known to fit", None,
         (autofit.Plan(6, 2, checkpointing=True), "forward")),
        ("micro 5 x 2, fp32, checkpointing", "probe a larger micro-batch", "micro 4 x 2, fp32, checkpointing",
         None),
    ]

