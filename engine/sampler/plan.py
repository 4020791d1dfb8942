"""The host-side view of one batch composition (`Plan`): which passes the step runs and on which rows, built from the
slots' `Kind`s and cached per slot list until a slot changes (`Plans`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler.state import SlotState
from model.kv_cache import device_index


@dataclass
class Plan:
    """The host-side view of one batch composition, cached until a slot changes."""

    n: int
    rows: slice | torch.Tensor  # the slots as a view (contiguous) or an index
    index: torch.Tensor  # the slots as an index (B,)
    greedy: torch.Tensor | None  # (B,) bool where greedy, None when no row or every row is
    all_greedy: bool
    any_sampled: bool  # temperature rows without top-k
    topk_rows: torch.Tensor | None  # batch rows with top-k (None: none; all rows: topk_all)
    topk_all: bool
    k_max: int
    top_p: bool  # some temperature row (not top-k) has top-p
    top_p_in_k: bool
    repetition: bool
    presence_frequency: bool
    z_is_raw: bool  # no penalty, temperature 1 everywhere: processed logits == raw logits
    top_n: int
    bias: bool = False
    min_tokens: bool = False
    masked: bool = False  # some row is constrained: step() takes a bitmask for those rows
    mask_rows: torch.Tensor | None = None  # their batch rows (None: every row is)
    mask_greedy: torch.Tensor | None = None  # the batch rows of the constrained greedy ones
    mask_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # constrained top-k rows: in topk_rows, in the bitmask
    clamp: bool = False  # clamp d / T at EXP_FLOOR before its exp (a CPU and some row with temperature < 1)


class Plans:
    """The batch plans of a `SlotState`, for its slots at one `version` (cleared when a slot changes)."""

    def __init__(self, state: SlotState) -> None:
        self.state = state
        self._plans: dict = {}
        self._version = state.version

    def get(self, slots: range | list[int]) -> Plan:
        if self._version != self.state.version:  # a slot changed since the plans were made
            self._plans.clear()
            self._version = self.state.version
        key = ("range", slots.start, slots.stop) if isinstance(slots, range) and slots.step == 1 else tuple(slots)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make_plan(self.state, list(slots))
        return plan


def make_plan(state: SlotState, slots: list[int]) -> Plan:
    """The plan of a batch of `slots` (each holding a request)."""
    kinds = [state.kinds[s] for s in slots]
    if any(k is None for k in kinds):
        raise ValueError(f"a slot in {slots} holds no request")
    dev, n = state.device, len(slots)
    contiguous = slots == list(range(slots[0], slots[0] + n))
    index = device_index(slots, dev)
    rows = slice(slots[0], slots[0] + n) if contiguous else index
    greedy = [k.greedy for k in kinds]
    topk = [i for i, k in enumerate(kinds) if k.top_k]
    sampled = [i for i, k in enumerate(kinds) if not k.greedy and not k.top_k]
    constrained = [i for i, k in enumerate(kinds) if k.constrained]
    mask_greedy = [i for i in constrained if kinds[i].greedy]
    mask_topk = [i for i in constrained if kinds[i].top_k]
    return Plan(
        n=n, rows=rows, index=index,
        greedy=device_index(greedy, dev, torch.bool) if 0 < sum(greedy) < n else None,
        all_greedy=all(greedy), any_sampled=bool(sampled),
        topk_rows=device_index(topk, dev) if topk else None, topk_all=len(topk) == n,
        k_max=max((kinds[i].top_k for i in topk), default=0),
        top_p=any(kinds[i].top_p for i in sampled), top_p_in_k=any(kinds[i].top_p for i in topk),
        repetition=any(k.repetition for k in kinds),
        presence_frequency=any(k.presence_frequency for k in kinds),
        z_is_raw=all(k.unit_temperature and not k.repetition and not k.presence_frequency and not k.bias
                     and not k.min_tokens for k in kinds),
        top_n=max(k.top_n for k in kinds), bias=any(k.bias for k in kinds),
        min_tokens=any(k.min_tokens for k in kinds), masked=bool(constrained),
        mask_rows=device_index(constrained, dev) if 0 < len(constrained) < n else None,
        mask_greedy=device_index(mask_greedy, dev) if mask_greedy else None,
        clamp=dev.type == "cpu" and any(k.sharpened for k in kinds),
        mask_topk=(device_index([topk.index(i) for i in mask_topk], dev),
                   device_index([constrained.index(i) for i in mask_topk], dev)) if mask_topk else None)
