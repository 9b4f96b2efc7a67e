"""The cheapest assignment of formats under a predicted-loss budget, as a Lagrangian solve: for a price λ each unit
takes the format minimising cost + λ x error on its own. As λ rises from 0 the units switch, one at a time, along the
lower convex hull of their (cost, error) points; those switches in order of λ give the whole frontier, from the
cheapest mix to the most accurate, each mix the cheapest for its predicted loss (the sum of its units' errors)."""
from dataclasses import dataclass

from llmc.tune.sensitivity import Unit


@dataclass(frozen=True)
class Mix:
    choice: tuple[str, ...]  # per unit, the candidate label it takes
    cost: float
    predicted: float  # the sum of the units' errors in their formats

    def counts(self) -> dict[str, int]:
        return {label: self.choice.count(label) for label in sorted(set(self.choice))}


def mix_of(units: list[Unit], choice: list[str] | tuple[str, ...]) -> Mix:
    return Mix(tuple(choice), sum(unit.cost[label] for unit, label in zip(units, choice)),
               sum(unit.error[label] for unit, label in zip(units, choice)))


def lower_hull(unit: Unit, allowed: set[str]) -> list[str]:
    """The unit's labels on the lower-left convex hull of (cost, error), by cost ascending: the only ones a price picks."""
    points = sorted((unit.cost[label], unit.error[label], label) for label in unit.error if label in allowed)
    kept: list[tuple[float, float, str]] = []
    for point in points:
        if kept and point[1] >= kept[-1][1]:  # costs as much or more for no less error
            continue
        while len(kept) >= 2 and _not_convex(kept[-2], kept[-1], point):
            kept.pop()
        kept.append(point)
    return [label for _, _, label in kept]


def _not_convex(a: tuple, b: tuple, c: tuple) -> bool:
    """b lies on or above the segment a-c: some price prefers a or c to it."""
    return (b[1] - a[1]) * (c[0] - a[0]) >= (c[1] - a[1]) * (b[0] - a[0])


def frontier(units: list[Unit], allowed: set[str]) -> list[Mix]:
    """Every mix a price λ picks, cheapest first; each next one switches one unit one step along its hull."""
    hulls = [lower_hull(unit, allowed) for unit in units]
    empty = [unit.label for unit, hull in zip(units, hulls) if not hull]
    if empty:
        raise ValueError(f"no candidate fits {', '.join(empty[:4])}: add one without groups (W8A16, keep)")
    switches = []
    for index, (unit, hull) in enumerate(zip(units, hulls)):
        for step, (cheaper, dearer) in enumerate(zip(hull, hull[1:])):
            price = (unit.cost[dearer] - unit.cost[cheaper]) / (unit.error[cheaper] - unit.error[dearer])
            switches.append((price, index, step, dearer))
    choice = [hull[0] for hull in hulls]
    mixes = [mix_of(units, choice)]
    for _, index, _, label in sorted(switches):
        choice[index] = label
        mixes.append(mix_of(units, choice))
    return mixes


def least_error_within(mixes: list[Mix], max_cost: float) -> int | None:
    """The frontier index of the most accurate mix costing at most max_cost (None when even the cheapest costs more)."""
    within = [index for index, mix in enumerate(mixes) if mix.cost <= max_cost * (1 + 1e-9)]
    return within[-1] if within else None
