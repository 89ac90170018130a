"""Step order: a topological sort over plain names (no I/O)."""
from __future__ import annotations


class CycleError(ValueError):
    def __init__(self, cycle: list[str]):
        self.cycle = cycle
        super().__init__(" -> ".join(cycle))


def run_order(parents: dict[str, list[str]]) -> list[str]:
    """Every step after the steps it reads; among steps that are ready at once, the order
    of the file (dicts keep it). Raises CycleError naming one cycle, first step repeated
    at the end."""
    done: set[str] = set()
    order: list[str] = []
    remaining = list(parents)
    while remaining:
        ready = next((s for s in remaining if all(p in done for p in parents[s])), None)
        if ready is None:
            raise CycleError(_find_cycle(parents, remaining))
        order.append(ready)
        done.add(ready)
        remaining.remove(ready)
    return order


def _find_cycle(parents: dict[str, list[str]], remaining: list[str]) -> list[str]:
    # Every remaining step waits on a remaining step, so walking parents must revisit one.
    path, seen = [], {}
    step = remaining[0]
    while step not in seen:
        seen[step] = len(path)
        path.append(step)
        step = next(p for p in parents[step] if p in remaining)
    flow = list(reversed(path[seen[step]:]))  # data flows parent -> child
    return flow + [flow[0]]
