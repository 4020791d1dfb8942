"""The prefix index on its own (engine/prefix_cache.py): longest common prefix over slots, block granularity,
truncation, copies, swaps and hash collisions."""

from __future__ import annotations

import random

from engine.prefix_cache import PrefixIndex


def test_the_longest_common_prefix_is_found_past_the_last_whole_block():
    ix = PrefixIndex(4, block=4)
    ix.extend(0, list(range(10)))  # 2 whole blocks + 2
    ix.extend(1, list(range(7)) + [99])  # 1 whole block, then 3 more in common, then a difference
    k, slots = ix.match(list(range(12)))
    assert (k, slots) == (10, [0])
    k, slots = ix.match(list(range(6)) + [50, 51])
    assert k == 6 and sorted(slots) == [0, 1]
    assert ix.match([1, 2, 3, 4, 5]) == (0, [])  # no whole first block in common
    assert ix.match([0, 1, 2]) == (0, [])  # shorter than one block: never matched


def test_equal_slots_are_all_offered_and_truncate_copy_swap_keep_the_index_true():
    ix = PrefixIndex(3, block=2)
    ix.extend(0, [1, 2, 3, 4, 5])
    ix.copy(0, 1, 4)
    assert ix.tokens[1] == [1, 2, 3, 4]
    k, slots = ix.match([1, 2, 3, 4, 9])
    assert k == 4 and sorted(slots) == [0, 1]
    ix.truncate(0, 3)
    assert ix.match([1, 2, 3, 4, 9]) == (4, [1])
    ix.swap(1, 2)
    assert ix.tokens[1] == [] and ix.match([1, 2, 3, 4, 9]) == (4, [2])
    ix.extend(2, [6, 7])
    assert ix.match([1, 2, 3, 4, 6, 7, 8]) == (6, [2])
    ix.clear()
    assert ix.match([1, 2, 3, 4]) == (0, []) and not ix.index


def test_holds_catches_a_hash_collision():
    ix = PrefixIndex(2, block=2)
    ix.extend(0, [1, 2, 3, 4])
    h = ix.chains[0][0]
    ix.index.setdefault(hash((0, (8, 9))), set()).add(0)  # pretend [8, 9] collides with [1, 2]
    k, slots = ix.match([8, 9, 5])
    assert k == 2 and slots == [0]
    assert not ix.holds(0, [8, 9, 5], 2) and ix.holds(0, [1, 2, 5], 2)
    assert h in ix.index


def test_random_edits_agree_with_a_brute_force_longest_common_prefix():
    rng = random.Random(0)
    n, B = 6, 3
    ix = PrefixIndex(n, block=B)
    for _ in range(400):
        s = rng.randrange(n)
        op = rng.random()
        if op < 0.4:
            ix.extend(s, [rng.randrange(3) for _ in range(rng.randrange(1, 8))])
        elif op < 0.6:
            ix.truncate(s, rng.randrange(len(ix.tokens[s]) + 1))
        elif op < 0.75:
            d = rng.randrange(n)
            if d != s:
                ix.copy(s, d, rng.randrange(len(ix.tokens[s]) + 1))
        else:
            ix.swap(s, rng.randrange(n))
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]

        def lcp(t, prompt=prompt):
            m = 0
            while m < min(len(t), len(prompt)) and t[m] == prompt[m]:
                m += 1
            return m

        best = max(lcp(t) for t in ix.tokens)
        k, slots = ix.match(prompt)
        if best < B:
            assert (k, slots) == (0, [])
        else:
            assert k == best and sorted(slots) == [i for i, t in enumerate(ix.tokens) if lcp(t) == best]
        for i, t in enumerate(ix.tokens):  # the index holds exactly each slot's whole blocks
            assert len(ix.chains[i]) == len(t) // B
            assert all(i in ix.index[h] for h in ix.chains[i])
