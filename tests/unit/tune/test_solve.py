"""The frontier solve: every mix on it is the most accurate for its cost among all assignments (brute force)."""
import itertools
import random

import pytest

from llmc.tune.sensitivity import Unit
from llmc.tune.solve import frontier, least_error_within, lower_hull, mix_of


def random_units(seed: int, count: int = 4) -> list[Unit]:
    rng = random.Random(seed)
    units = []
    for index in range(count):
        # keep costs most with no error; the others cost less and lose more, with noise
        error = {"keep": 0.0, "w8": rng.uniform(0, 0.01), "w4": rng.uniform(0.01, 1), "w3": rng.uniform(0.5, 3)}
        cost = {"keep": 16.0, "w8": rng.uniform(7, 9), "w4": rng.uniform(3.5, 5), "w3": rng.uniform(2.5, 4)}
        units.append(Unit(index, [f"model.layers.{index}.mlp.down_proj"], error, cost))
    return units


@pytest.mark.parametrize("seed", range(6))
def test_each_frontier_mix_is_the_most_accurate_for_its_cost(seed):
    units = random_units(seed)
    labels = ["keep", "w8", "w4", "w3"]
    every = [mix_of(units, choice) for choice in itertools.product(labels, repeat=len(units))]
    mixes = frontier(units, set(labels))
    assert mixes[0].cost == min(mix.cost for mix in every)
    assert mixes[-1].predicted == 0.0
    assert all(a.cost <= b.cost and a.predicted >= b.predicted for a, b in itertools.pairwise(mixes))
    for mix in mixes:
        best = min(other.predicted for other in every if other.cost <= mix.cost + 1e-9)
        assert mix.predicted == pytest.approx(best)


def test_the_hull_drops_dominated_and_never_chosen_formats():
    unit = Unit(0, ["q"], {"a": 1.0, "b": 0.9, "c": 0.5, "d": 0.1, "e": 0.6}, {"a": 1.0, "b": 2.9, "c": 3.0, "d": 5.0, "e": 4.0})
    # e costs more than c for more error; b lies above the segment a-c, so no price picks it
    assert lower_hull(unit, set(unit.error)) == ["a", "c", "d"]
    assert lower_hull(unit, {"b", "e"}) == ["b", "e"]


def test_a_format_that_does_not_fit_a_unit_is_not_chosen_for_it():
    units = random_units(0, 2)
    del units[1].error["w4"], units[1].cost["w4"]  # e.g. a group size that does not divide its width
    assert all(mix.choice[1] != "w4" for mix in frontier(units, {"keep", "w8", "w4", "w3"}))
    with pytest.raises(ValueError, match="no candidate fits 1:down_proj"):
        frontier(units, {"w4"})


def test_least_error_within_a_cost():
    mixes = frontier(random_units(1), {"keep", "w8", "w4", "w3"})
    index = least_error_within(mixes, mixes[3].cost)
    assert index >= 3 and mixes[index].cost <= mixes[3].cost and (index + 1 == len(mixes) or mixes[index + 1].cost > mixes[3].cost)
    assert least_error_within(mixes, mixes[0].cost * 0.5) is None
