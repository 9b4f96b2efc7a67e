"""A draft tree: candidate continuations of a sequence that share prefixes. Nodes are listed parents first (by
depth), so any leading slice of them is itself a tree; a chain is the tree where every node's parent is the one before."""
from dataclasses import dataclass, field

ROOT = -1  # parent of the first-level nodes: the sequence's last token


@dataclass(slots=True)
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Distance to the sequence's last token: 1 for the first-level nodes."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def path(self, node: int) -> list[int]:
        """The nodes from the first level down to node, inclusive."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def children(self, node: int) -> list[int]:
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def truncated(self, num_nodes: int) -> "DraftTree":
        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes])
