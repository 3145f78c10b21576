"""Radix prefix cache: prompt KV pages shared across requests by common token prefix.

The tree is keyed by token ids at page granularity: every node holds a run of whole pages (its key
is a multiple of `page_size` tokens), so a match is always page aligned and a shared page is never
written again (a request's partial last prompt page stays private). The tree holds one reference
on each of its pages; a request that matches a prefix adds its own. Leaves whose pages only the
tree references are evictable, least recently used first. `flush` detaches everything: running
requests keep their references (their pages live until they finish), new requests miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl_mcore.rollout.engine.kv_pool import KVPool


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    pages: list[int]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass
class RadixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    """Token-id radix tree over page runs, with LRU eviction of unreferenced leaves."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.root = _Node(tokens=(), pages=[], parent=None)
        self.stats = RadixStats()
        self._clock = 0
        self.num_pages = 0

    def _first_page(self, tokens: tuple[int, ...], start: int) -> tuple[int, ...]:
        return tokens[start : start + self.page_size]

    def _walk(self, tokens: tuple[int, ...], limit: int) -> tuple[_Node, list[int], int]:
        """Deepest node matching tokens[:limit] page by page (splitting a node matched part way)."""
        node, pages, i, ps = self.root, [], 0, self.page_size
        self._clock += 1
        while i + ps <= limit:
            child = node.children.get(self._first_page(tokens, i))
            if child is None:
                break
            n = 1
            while n < len(child.pages) and i + (n + 1) * ps <= limit:
                if child.tokens[n * ps : (n + 1) * ps] != tokens[i + n * ps : i + (n + 1) * ps]:
                    break
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_used = self._clock
            pages.extend(child.pages)
            i += n * ps
            node = child
        return node, pages, i

    def _split(self, node: _Node, n_pages: int) -> _Node:
        """Cut `node` after n_pages pages; returns the new upper node (the old one becomes its child)."""
        cut = n_pages * self.page_size
        upper = _Node(tokens=node.tokens[:cut], pages=node.pages[:n_pages], parent=node.parent)
        upper.last_used = node.last_used
        assert node.parent is not None
        node.parent.children[self._first_page(node.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[n_pages:], upper
        upper.children[self._first_page(node.tokens, 0)] = node
        return upper

    def match(self, tokens: tuple[int, ...], limit: int) -> list[int]:
        """Pages caching the longest page-aligned prefix of tokens[:limit]; each gets a new
        reference for the caller (release them with pool.decref)."""
        _, pages, matched = self._walk(tokens, limit)
        self.stats.queried_tokens += limit
        self.stats.hit_tokens += matched
        self.pool.incref(pages)
        return pages

    def insert(self, tokens: tuple[int, ...], pages: list[int]) -> None:
        """Cache `pages` as the KV of tokens[: len(pages) * page_size]; already cached pages win."""
        limit = len(pages) * self.page_size
        node, cached, i = self._walk(tokens, limit)
        if i == limit:
            return
        new_pages = pages[len(cached) :]
        leaf = _Node(tokens=tokens[i:limit], pages=new_pages, parent=node, last_used=self._clock)
        node.children[self._first_page(tokens, i)] = leaf
        self.pool.incref(new_pages)
        self.num_pages += len(new_pages)

    def evict(self, n_pages: int) -> int:
        """Free at least n_pages pages from unreferenced leaves, LRU first; returns pages freed."""
        freed = 0
        while freed < n_pages:
            leaves = [n for n in self._nodes() if not n.children and self._unreferenced(n)]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            self._remove(victim)
            freed += len(victim.pages)
        return freed

    def flush(self) -> None:
        """Forget every entry (weights changed): drop the tree's references, keep requests' ones."""
        for node in self._nodes():
            self.pool.decref(node.pages)
        self.root = _Node(tokens=(), pages=[], parent=None)
        self.num_pages = 0

    def cached_pages(self) -> list[int]:
        """Every page the tree holds a reference on."""
        return [p for node in self._nodes() for p in node.pages]

    def _unreferenced(self, node: _Node) -> bool:
        return all(self.pool.refs[p] == 1 for p in node.pages)

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[self._first_page(node.tokens, 0)]
        self.pool.decref(node.pages)
        self.num_pages -= len(node.pages)

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
