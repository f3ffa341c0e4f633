"""The gradient-flow arbiter (training.gates.runtime.gradient_flow_from_grads) on hand-made gradients.

Its rule, from the project's first requirement: every trainable parameter receives a gradient that
exists, is finite and is nonzero; a weight matrix (not an embedding, whose absent tokens' rows are
legitimately zero) with whole rows of zero gradient is a dead slice. The verdict counts parameters:
value = trainable parameters that pass, threshold = all of them. Each case here sits where a slip in
the loop would hide the next parameter (a frozen or gradient-less one first) — the mutants
`continue` -> `break`, `and` -> `or` and `+ len(dead)` -> `- len(dead)` that survived the end-to-end
tests (issue [proof]).
"""

from __future__ import annotations

import torch

from training.gates.runtime import gradient_flow_from_grads


def param(grad: list | None, trainable: bool = True) -> torch.nn.Parameter:
    value = torch.tensor(grad if grad is not None else [1.0])
    p = torch.nn.Parameter(torch.ones_like(value), requires_grad=trainable)
    if grad is not None and trainable:
        p.grad = value.clone()
    return p


HEALTHY_MATRIX = [[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]]  # a zero entry is not a zero row


def test_every_healthy_parameter_counts_and_frozen_ones_do_not() -> None:
    named = [("frozen.weight", param(None, trainable=False)),  # first: a loop that stops here sees nothing
             ("layers.0.attention.wq.weight", param(HEALTHY_MATRIX)),
             ("layers.0.attention_norm.weight", param([1.0, 0.0, 2.0])),  # a vector may hold zeros
             ("tok_embeddings.weight", param([[0.0, 0.0], [1.0, 2.0]]))]  # an absent token's row: fine
    r = gradient_flow_from_grads(named)
    assert r.passed and r.value == 3.0 and r.threshold == "3 of 3 parameters"
    assert r.detail == "all 3 trainable parameters receive finite, nonzero gradients"


def test_each_kind_of_failure_is_named_and_counted() -> None:
    named = [("a.weight", param(None)),  # trainable, no gradient at all
             ("b.weight", param([1.0, float("nan")])),
             ("c.weight", param([[0.0, 0.0], [0.0, 0.0]])),
             ("d.weight", param([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 0.0]])),  # 2 dead rows of 4
             ("e.weight", param([float("inf"), 1.0])),
             ("f.weight", param(HEALTHY_MATRIX))]
    r = gradient_flow_from_grads(named)
    assert not r.passed and r.value == 1.0 and r.threshold == "6 of 6 parameters"
    assert r.detail == ("no gradient: a.weight; non-finite gradient: b.weight, e.weight; all-zero gradient: c.weight; "
                        "rows with zero gradient: d.weight (2 of 4 rows)")


def test_a_parameter_without_gradient_does_not_hide_the_ones_after_it() -> None:
    r = gradient_flow_from_grads([("a.weight", param(None)), ("b.weight", param([0.0, 0.0]))])
    assert not r.passed and r.value == 0.0 and r.detail == "no gradient: a.weight; all-zero gradient: b.weight"


def test_one_dead_slice_alone_fails_the_gate() -> None:
    """A kernel dropping one head's gradient: the rest of the matrix is healthy, the gate still fails."""
    dead_head = [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    r = gradient_flow_from_grads([("layers.1.attention.wo.weight", param(dead_head)), ("x.weight", param([1.0]))])
    assert not r.passed and r.value == 1.0 and r.threshold == "2 of 2 parameters"
    assert r.detail == "rows with zero gradient: layers.1.attention.wo.weight (2 of 4 rows)"


def test_a_three_dimensional_gradient_is_judged_by_its_first_dimension() -> None:
    """A stacked weight (e.g. experts x out x in): a slice is dead only if all of it is zero."""
    g = torch.ones(3, 2, 2)
    g[1, 0] = 0.0  # part of slice 1: still alive
    p = torch.nn.Parameter(torch.ones(3, 2, 2))
    p.grad = g.clone()
    assert gradient_flow_from_grads([("experts.weight", p)]).passed
    p.grad[1] = 0.0
    r = gradient_flow_from_grads([("experts.weight", p)])
    assert not r.passed and r.detail == "rows with zero gradient: experts.weight (1 of 3 rows)"


def test_a_gate_with_no_trainable_parameter_fails() -> None:
    """A check that compared nothing has failed (README's standards): zero of zero is not a pass."""
    for named in ([], [("frozen.weight", param(None, trainable=False))]):
        r = gradient_flow_from_grads(named)
        assert not r.passed and r.value == 0.0 and r.detail == "no trainable parameter to judge"
