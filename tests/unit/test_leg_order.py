"""The backward order of legs (:func:`megatron_domino.engine.legs.backward_order`), as data.

No process group, no model: chains of legs named by chunk and position, and the order the
driver would run them in. What a leg does is the multi-rank tests' business
(``tests/ranks/test_backward_order.py``).
"""

from __future__ import annotations

import pytest

from megatron_domino.engine.legs import Leg, backward_order


def _chains(p: int, legs: int) -> list[list[Leg]]:
    return [[Leg(c, j, f"op{j}", 0) for j in range(legs)] for c in range(p)]


def _order(p: int, legs: int, **kwargs) -> list[tuple[int, int]]:
    return [(leg.chunk, leg.position) for leg in backward_order(_chains(p, legs), **kwargs)]


def _between(order: list[tuple[int, int]], chunk: int, position: int) -> list[tuple[int, int]]:
    """The legs of other chunks run between chunk ``chunk``'s leg ``position`` and its leg
    ``position - 1`` (the next in backward): what a collective launched by the first and
    waited by the second flies behind."""
    start, end = order.index((chunk, position)), order.index((chunk, position - 1))
    return order[start + 1 : end]


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_leg_runs_once_each_chunk_last_leg_first(p, lag):
    order = _order(p, 6, lag=lag)
    assert sorted(order) == [(c, j) for c in range(p) for j in range(6)]
    for c in range(p):
        assert [j for chunk, j in order if chunk == c] == list(reversed(range(6)))


def test_lag_0_runs_legs_of_one_position_together_last_chunk_first():
    assert _order(2, 3, lag=0) == [(1, 2), (0, 2), (1, 1), (0, 1), (1, 0), (0, 0)]


def test_lag_1_puts_each_chunk_one_leg_behind_the_next():
    assert _order(2, 3, lag=1) == [(1, 2), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)]


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("p", [2, 4])
def test_in_the_steady_state_p_minus_1_other_legs_run_between_a_chunks_two_legs(p, lag):
    """Every collective launched at a cut flies behind one leg of each other chunk."""
    legs, ramp = 12, lag * (p - 1)  # the lag's ramp at both ends of the chains
    order = _order(p, legs, lag=lag)
    for c in range(p):
        for position in range(1 + ramp, legs - ramp):
            others = _between(order, c, position)
            assert sorted(chunk for chunk, _ in others) == [o for o in range(p) if o != c]


def test_later_chunks_run_a_position_before_earlier_chunks():
    """Under the sequence split a later chunk's leg hands gradients to the keys and values of
    an earlier chunk's leg of the same position: it must run first."""
    for lag in (0, 1):
        order = _order(4, 6, lag=lag)
        for j in range(6):
            runs = [order.index((c, j)) for c in range(4)]
            assert runs == sorted(runs, reverse=True)


def test_serial_runs_each_chunk_back_to_back_with_nothing_between():
    order = _order(2, 3, lag=0, serial=True)
    assert order == [(1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]
    assert _between(order, 1, 2) == [] and _between(order, 0, 1) == []
