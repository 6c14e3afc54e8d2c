"""A radix tree of token ids with lock counts and LRU leaf eviction (the GPU mode's prefix cache).

Modelled on SGLang's `python/sglang/srt/mem_cache/radix_cache.py`: edges carry runs of
token ids, a node shared by running requests is locked (`lock_ref` counted up the path to
the root) and cannot be evicted, and `evict(n)` removes unlocked leaves, least recently
used first, until n tokens are freed (a whole leaf at a time, so it may free more).
Sizes are in tokens: every cached token holds one KV slot of the pool.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class Node:
    """One edge of the tree: `key` is the run of token ids from the parent to this node."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: list[int], parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    """Prefix matching, insertion, locking and LRU eviction over token ids."""

    def __init__(self) -> None:
        self.root = Node([], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.total_tokens = 0
        self.protected_tokens = 0  # tokens in nodes some running request has locked
        self._clock = itertools.count(1)

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens no running request uses: free for the taking."""
        return self.total_tokens - self.protected_tokens

    def match_prefix(self, ids: Sequence[int]) -> tuple[int, Node]:
        """Length of the longest cached prefix of ids and the node where it ends."""
        node, matched, tick = self.root, 0, next(self._clock)
        while matched < len(ids):
            child = node.children.get(ids[matched])
            if child is None:
                break
            common = _common_length(child.key, ids, matched)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = tick
            node, matched = child, matched + common
        return matched, node

    def peek_prefix(self, ids: Sequence[int]) -> int:
        """Cached prefix length of ids, leaving the tree and its LRU order untouched."""
        node, matched = self.root, 0
        while matched < len(ids):
            child = node.children.get(ids[matched])
            if child is None:
                break
            common = _common_length(child.key, ids, matched)
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, ids: Sequence[int]) -> tuple[int, Node]:
        """Cache ids; returns (tokens that were already cached, the node ending ids)."""
        matched, node = self.match_prefix(ids)
        if matched < len(ids):
            leaf = Node(list(ids[matched:]), node)
            leaf.last_access = next(self._clock)
            node.children[leaf.key[0]] = leaf
            self.total_tokens += len(leaf.key)
            node = leaf
        return matched, node

    def inc_lock(self, node: Node) -> None:
        """Protect node and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = _parent(node)

    def dec_lock(self, node: Node) -> None:
        """Undo one inc_lock(node)."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_tokens -= len(node.key)
            node = _parent(node)

    def evict(self, tokens: int) -> int:
        """Drop unlocked leaves, least recently used first, until `tokens` are freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = _parent(leaf)
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Forget everything (only when nothing is locked: /flush_cache)."""
        self.root.children.clear()
        self.total_tokens = self.protected_tokens = 0

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge after `at` tokens; returns the new upper node."""
        parent = _parent(child)
        upper = Node(child.key[:at], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out


def _parent(node: Node) -> Node:
    assert node.parent is not None, "the root has no parent"
    return node.parent


def _common_length(key: list[int], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i
