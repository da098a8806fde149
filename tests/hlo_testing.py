"""Which collectives a compiled program runs, over which axes of a mesh, on what types."""

import itertools
import re

import numpy as np

OPS = r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("


def _iota_groups(match) -> set[frozenset[int]]:
    """XLA's iota replica groups `[n,size]<=[dims]T(perm)`."""
    n, size, dims, perm = match.groups()
    grid = np.arange(int(n) * int(size)).reshape([int(d) for d in dims.split(",")])
    if perm:
        grid = grid.transpose([int(p) for p in perm.split(",")])
    return {frozenset(row) for row in grid.reshape(int(n), int(size)).tolist()}


def group_axis(line: str, mesh) -> str:
    """The mesh axis a collective's replica groups span ("tp"; "data,fsdp" for several, the
    fewest that span them), else the groups as text."""
    named = re.search(r"replica_groups=mesh\[[^\]]*\] \{'(\w+)'\}", line)
    if named:
        return named.group(1)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    listed = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
    if iota:
        groups = _iota_groups(iota)
    elif listed:
        groups = {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", listed[1])}
    else:
        return line
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = mesh.axis_names
    for count in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), count):
            rest = [a for a in range(len(names)) if a not in axes]
            rows = np.transpose(ids, rest + list(axes)).reshape(
                int(np.prod([ids.shape[a] for a in rest])), -1
            )
            if groups == {frozenset(row) for row in rows.tolist()}:
                return ",".join(names[a] for a in axes)
    return str(sorted(map(sorted, groups)))


def collectives(hlo: str, mesh) -> set[tuple[str, str, frozenset[str]]]:
    """(op, axis, element types of its result) of every collective in compiled HLO text."""
    found = set()
    for line in hlo.splitlines():
        op = re.match(r"\s*(?:ROOT )?\S+ = (.*?) " + OPS, line)
        if op:
            types = frozenset(re.findall(r"(\w+)\[", op.group(1)))
            found.add((op.group(2), group_axis(line, mesh), types))
    return found
