"""The prompt cache: KV states of token prefixes, kept between rows, jobs and chat turns, so a row
that starts with a cached prefix adopts it and prefills only the rest (PrefillPlan rule 1, docs/design.md).

Index: a radix tree over token ids. Each node holds a segment of tokens and the KV the pool
stored for exactly those positions (every layer's arrays, as the layer's cache stores them:
model dtype or quantized parts). Why a radix tree rather than block hashes: entries are copies
kept outside the job's KV pool (the pool lives for one job; the cache outlives it, for chat
turns, the server and the disk), so nothing ties them to blocks, and adoption is then at token
granularity: a template that renders earlier turns differently next time (Qwen3 drops old
`<think>` blocks) adopts exactly the longest common token prefix, not the last whole block.

Memory: the nodes' arrays count against their own budget (`runner.prompt_cache_gb`); inserting
past it evicts least recently used leaves first. A node on the path a prefilling row adopted or
extends is pinned and never evicted. Every choice here depends on the rows and their order only
(a use counter, not a clock), so reruns evict the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

PROMPT_CACHE_SHARE = 0.1  # of device memory (RAM on the CPU) by default, beside the KV pool's share
# (layer) -> the arrays that layer's cache stores for a span of positions, each [positions, ...]
Stored = list[list[mx.array]]


@dataclass(eq=False)
class Node:
    tokens: np.ndarray  # int32 [n]: this node's segment (the path from the root spells the prefix)
    stored: Stored  # per layer, [n, ...] each
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)  # first token of the child's segment -> child
    used: int = 0  # the cache's use counter when last matched or inserted
    pins: int = 0  # rows relying on this node (adopted it, or will extend it)
    saved: bool = False  # written to the cache folder already
    # A hybrid's recurrent layers: their states after the node's last position (per layer, [1, ...]
    # each; [] for attention layers), which `stored` cannot hold (a state is not per position).
    # None where unknown (a split point, an answer): a hybrid's row adopts only up to a node with them.
    states: Stored | None = None

    @property
    def nbytes(self) -> int:
        arrays = [*self.stored, *(self.states or [])]
        return sum(a.nbytes for layer in arrays for a in layer)


@dataclass
class Match:
    """A cached prefix of a row's tokens: its length and the nodes it runs through (the last
    one possibly used in part)."""

    length: int = 0
    nodes: list[Node] = field(default_factory=list)
    used: list[int] = field(default_factory=list)  # tokens of each node that the prefix covers

    def states(self) -> Stored | None:
        """A hybrid's recurrent states after the prefix (its last node's), or None."""
        return self.nodes[-1].states if self.nodes and self.used[-1] == len(self.nodes[-1].tokens) else None

    def stored(self) -> Stored:
        """Every layer's arrays for the prefix's positions, joined along positions."""
        if not self.nodes:
            return []
        joined = []
        for i in range(len(self.nodes[0].stored)):
            pieces = [[a[:used] for a in node.stored[i]] for node, used in zip(self.nodes, self.used)]
            joined.append([mx.concatenate(arrays) if len(arrays) > 1 else arrays[0] for arrays in zip(*pieces)])
        return joined


class PromptCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.root = Node(np.zeros(0, dtype=np.int32), [])
        self.nbytes = 0
        self.clock = 0
        self.evicted_tokens = 0  # over the cache's life (stats.json's prompt_cache.evicted_tokens)
        self.folder_error: str | None = None  # why runner.prompt_cache_dir takes no entries (said once)

    # ---- lookup ----
    def match(self, tokens: list[int] | np.ndarray, limit: int | None = None, with_states: bool = False) -> Match:
        """The longest cached prefix of `tokens[:limit]`; `with_states`: the longest that ends
        where a node keeps its recurrent states (what a hybrid's row can adopt)."""
        tokens = np.asarray(tokens[:limit] if limit is not None else tokens, dtype=np.int32)
        found, node, pos = Match(), self.root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            common = count_common(child.tokens, tokens[pos:])
            found.nodes.append(child)
            found.used.append(common)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        found.length = pos
        return cut_to_states(found) if with_states else found

    def touch(self, found: Match) -> None:
        self.clock += 1
        for node in found.nodes:
            node.used = self.clock

    def pin(self, found: Match, delta: int = 1) -> None:
        for node in found.nodes:
            node.pins += delta

    # ---- insertion ----
    def insert(self, tokens: list[int] | np.ndarray, start: int, stored: Stored, states: Stored | None = None) -> Match:
        """Record that positions [start, len(tokens)) of `tokens` hold `stored` (per layer,
        [len(tokens) - start, ...]), and a hybrid's recurrent `states` after the last of them.
        Only what the tree lacks is added, and only where the tree already holds [0, start) (a
        prefix evicted meanwhile leaves a gap: nothing is added). Returns the match of the whole
        of `tokens` afterwards (empty where nothing could be)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        found = self.match(tokens)
        end = len(tokens)
        if found.length < start:
            return Match()
        if found.length < end:
            parent = self.split_at(found)
            skip = found.length - start
            node = Node(tokens[found.length :].copy(), [[a[skip:] for a in layer] for layer in stored], parent=parent)
            node.stored = [[mx.contiguous(a) if skip else a for a in layer] for layer in node.stored]
            needed = node.nbytes
            self.make_room(needed, keep=found.nodes)
            if self.nbytes + needed > self.budget_bytes:
                self.touch(found)
                return found if found.length else Match()
            parent.children[int(node.tokens[0])] = node
            self.nbytes += needed
            found.nodes.append(node)  # (split_at left `found` ending exactly at `parent`)
            found.used.append(len(node.tokens))
            found.length = end
        if states is not None and found.length == end:
            self.attach_states(found, states)
        self.touch(found)
        return found

    def attach_states(self, found: Match, states: Stored) -> None:
        """Keep `states` at the end of `found` (splitting its last node there), if none are kept yet."""
        node = self.split_at(found)
        if node is self.root or node.states is not None:
            return
        needed = sum(a.nbytes for layer in states for a in layer)
        self.make_room(needed, keep=found.nodes)
        if self.nbytes + needed <= self.budget_bytes:
            node.states = states
            self.nbytes += needed

    def split_at(self, found: Match) -> Node:
        """The node that ends exactly where `found` ends, splitting its last node if the match
        stops inside it; `found` is updated to run through the first half."""
        if not found.nodes:
            return self.root
        node, used = found.nodes[-1], found.used[-1]
        if used == len(node.tokens):
            return node
        head = Node(
            node.tokens[:used].copy(),
            [[a[:used] for a in layer] for layer in node.stored],
            parent=node.parent,
            used=node.used,
            pins=node.pins,
            saved=node.saved,
        )  # (no states: nothing knows a recurrent layer's state mid-node)
        node.parent.children[int(head.tokens[0])] = head
        node.tokens = node.tokens[used:].copy()
        node.stored = [[a[used:] for a in layer] for layer in node.stored]
        node.parent = head
        head.children[int(node.tokens[0])] = node
        found.nodes[-1] = head
        return head

    # ---- eviction ----
    def make_room(self, needed: int, keep: list[Node]) -> None:
        """Evict least recently used leaves (never pinned ones, nor `keep`) until `needed` more
        bytes fit the budget, or nothing more can go."""
        protected = {id(n) for n in keep}
        while self.nbytes + needed > self.budget_bytes:
            leaves = [n for n in self.iter_nodes() if not n.children and not n.pins and id(n) not in protected]
            if not leaves:
                return
            self.remove(min(leaves, key=lambda n: n.used))

    def remove(self, node: Node) -> None:
        del node.parent.children[int(node.tokens[0])]
        self.nbytes -= node.nbytes
        self.evicted_tokens += len(node.tokens)

    def iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def clear(self) -> None:
        self.root.children.clear()
        self.nbytes = 0

    @property
    def entries(self) -> int:
        return sum(1 for _ in self.iter_nodes())

    @property
    def cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.iter_nodes())


def cut_to_states(found: Match) -> Match:
    """`found` cut back to the end of its last whole node that keeps recurrent states."""
    keep = 0
    for i, (node, used) in enumerate(zip(found.nodes, found.used)):
        if used < len(node.tokens):
            break
        if node.states is not None:
            keep = i + 1
    found.nodes, found.used = found.nodes[:keep], found.used[:keep]
    found.length = sum(found.used)
    return found


def count_common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n
