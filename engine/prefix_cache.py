"""Which token prefixes the KV-cache slots hold: the index that prefix caching matches new prompts against.

Pure bookkeeping (no torch), owned by the scheduler (`engine.scheduler`), tested in `tests/test_prefix_cache.py`.

Every slot keeps the tokens whose keys and values it holds (positions 0..n-1), whether a request is running
there or the slot is idle and merely remembers what its last request left. Positions are learned absolute
embeddings, so only an exact prefix at the same positions can be reused: the index answers "which slots hold the
longest common prefix with this prompt", as llama.cpp's server does per slot, but through hashed blocks as vLLM's
`kv_cache_utils.py` does, so a match costs O(prompt blocks) dictionary lookups whatever the number of slots:

    chain[j] = hash((chain[j-1], tokens[j·B : (j+1)·B]))     one hash per full block of B tokens
    index[chain[j]] = {slots whose first (j+1)·B tokens are those}

A match walks the prompt's chain while some slot has it, then extends token by token past the last common block
(at most B - 1 more tokens per candidate); the scheduler checks the slot it picks against the prompt (`holds`: a hash
collision never reuses a wrong prefix). Slots shorter than one block are never matched.
"""

from __future__ import annotations

DEFAULT_BLOCK = 16


class PrefixIndex:
    def __init__(self, n_slots: int, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]  # what each slot's KV holds
        self.chains: list[list[int]] = [[] for _ in range(n_slots)]  # chain hash of each full block
        self.index: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ updates
    def extend(self, slot: int, tokens: list[int]) -> None:
        """The slot's KV now also holds `tokens` (appended after what it held)."""
        if not tokens:
            return
        held = self.tokens[slot]
        held.extend(tokens)
        chain, B = self.chains[slot], self.block
        prev = chain[-1] if chain else 0
        for j in range(len(chain), len(held) // B):
            prev = hash((prev, tuple(held[j * B:(j + 1) * B])))
            chain.append(prev)
            self.index.setdefault(prev, set()).add(slot)

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first n tokens of the slot (n = 0: the slot holds nothing)."""
        del self.tokens[slot][n:]
        chain = self.chains[slot]
        for h in chain[n // self.block:]:
            self._unindex(h, slot)
        del chain[n // self.block:]

    def copy(self, src: int, dst: int, n: int) -> None:
        """dst now holds the first n tokens of src (and nothing else)."""
        self.truncate(dst, 0)
        self.extend(dst, self.tokens[src][:n])

    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange what they hold."""
        if a == b:
            return
        for h in self.chains[a]:
            self._unindex(h, a)
        for h in self.chains[b]:
            self._unindex(h, b)
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.chains[a], self.chains[b] = self.chains[b], self.chains[a]
        for s in (a, b):
            for h in self.chains[s]:
                self.index.setdefault(h, set()).add(s)

    def clear(self) -> None:
        for s in range(len(self.tokens)):
            self.tokens[s], self.chains[s] = [], []
        self.index.clear()

    def _unindex(self, h: int, slot: int) -> None:
        slots = self.index.get(h)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self.index[h]

    # ------------------------------------------------------------------ matching
    def chain(self, tokens: list[int]) -> list[int]:
        """The chain hashes of the whole blocks of `tokens` (what `extend` would index)."""
        out, prev, B = [], 0, self.block
        for j in range(len(tokens) // B):
            prev = hash((prev, tuple(tokens[j * B:(j + 1) * B])))
            out.append(prev)
        return out

    def match(self, prompt: list[int], chain: list[int] | None = None) -> tuple[int, list[int]]:
        """(k, slots): the longest common prefix k that any slot shares with `prompt`, and the slots sharing it
        (k = 0, [] when no slot shares a whole block). `chain`: the prompt's `chain`, when already computed."""
        B = self.block
        cands, depth = None, 0
        for j, h in enumerate(chain if chain is not None else self.chain(prompt)):
            found = self.index.get(h)
            if not found:
                break
            cands, depth = found, j + 1
        if not cands:
            return 0, []
        base = depth * B
        tail = prompt[base:base + B]
        best, slots = 0, []
        for s in cands:
            held = self.tokens[s]
            n = 0
            for a, b in zip(held[base:base + B], tail):
                if a != b:
                    break
                n += 1
            if n > best or not slots:
                best, slots = n, [s]
            elif n == best:
                slots.append(s)
        return base + best, slots

    def holds(self, slot: int, prompt: list[int], k: int) -> bool:
        """Whether the slot's first k tokens are the prompt's: the check before a match is reused (block hashes can
        collide; the chosen slot is compared token by token, once)."""
        return len(self.tokens[slot]) >= k and self.tokens[slot][:k] == prompt[:k]
