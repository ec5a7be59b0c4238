"""A token tree's shape, fixed at trace time: node 0 is the pending token (the root), node i > 0 has
parent `parents[i] < i` and is the `ranks[i]`-th child of it. Every array a step needs (depths,
ancestor mask) follows from `parents`, so a shape is a hashable static argument of the jitted step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parents[0] == -1 (the root)

    def __post_init__(self):
        p = self.parents
        if not p or p[0] != -1 or any(not 0 <= q < i for i, q in enumerate(p) if i):
            raise ConfigError(f"tree parents must start with -1 and point to earlier nodes, got {list(p)}")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> np.ndarray:
        d = np.zeros(self.num_nodes, np.int32)
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def ranks(self) -> np.ndarray:
        """Sibling rank of each node (0 for the root): which of its parent's top choices it is."""
        r, seen = np.zeros(self.num_nodes, np.int32), {}
        for i in range(1, self.num_nodes):
            r[i] = seen.get(self.parents[i], 0)
            seen[self.parents[i]] = r[i] + 1
        return r

    @property
    def ancestors(self) -> np.ndarray:
        """[N, N] bool: ancestors[i, j] iff node j is node i or one of its ancestors."""
        a = np.eye(self.num_nodes, dtype=bool)
        for i in range(1, self.num_nodes):
            a[i] |= a[self.parents[i]]
        return a

    @property
    def children(self) -> np.ndarray:
        """[N, C] int32: each node's children in rank order, -1 past the last (C >= 1)."""
        kids = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        table = np.full((self.num_nodes, max(1, max(len(k) for k in kids))), -1, np.int32)
        for n, k in enumerate(kids):
            table[n, :len(k)] = k
        return table

    @staticmethod
    def chain(k: int) -> "TreeShape":
        return TreeShape((-1,) + tuple(range(k)))

    @staticmethod
    def for_budget(nodes: int, depth: int) -> "TreeShape":
        """`nodes` drafted nodes (root excluded) at most `depth` deep: the top-1 chain first, then
        second, third, ... choices added level by level from the top (shallow alternatives are
        the likeliest to be needed)."""
        if nodes < 1 or depth < 1:
            raise ConfigError(f"a tree needs >= 1 node and depth >= 1, got {nodes} nodes, depth {depth}")
        parents = [-1]
        chain = [0]
        for _ in range(min(depth, nodes)):
            parents.append(chain[-1])
            chain.append(len(parents) - 1)
        while len(parents) - 1 < nodes:
            for d in range(min(depth, nodes)):  # one more alternative under each chain node, top down
                if len(parents) - 1 == nodes:
                    break
                parents.append(chain[d])
        return TreeShape(tuple(parents))


def load_tree_shape(path) -> TreeShape:
    """A static tree shape from YAML: `parents: [-1, 0, 0, 1, ...]` (node 0 the root, every other
    node's parent an earlier node). Errors name the file and the field."""
    import yaml
    from pathlib import Path
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the tree shape: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    parents = doc.get("parents") if isinstance(doc, dict) else None
    if not isinstance(parents, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in parents):
        raise ConfigError(f"{path}: parents: expected a list of integers (node 0's parent -1), got {parents!r}")
    try:
        return TreeShape(tuple(parents))
    except ConfigError as e:
        raise ConfigError(f"{path}: parents: {e}") from None
