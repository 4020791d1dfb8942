"""The engine core's handle on speculative decoding (`Speculator`): each speculating request's tokens (prompt and
output, on the host), its proposal budget (`AdaptiveK`), the proposer of the configured method, and the counters
that /info and Prometheus report. The core asks it for proposals for a step's decoding rows, verifies them
(EngineCore._verify) and tells it how many each row accepted."""

from __future__ import annotations

from array import array
from collections.abc import Callable

from engine.spec_decode.adaptive import AdaptiveK
from engine.spec_decode.config import SpecConfig
from engine.spec_decode.costs import StepCosts
from engine.spec_decode.ngram import NgramProposer


class Speculator:
    def __init__(self, config: SpecConfig, draft=None) -> None:
        """`draft`: the DraftProposer (engine/spec_decode/draft.py) when the method is draft."""
        self.config = config.check()
        if config.method == "draft" and draft is None:
            raise ValueError("speculative method draft needs a DraftProposer")
        self.method = config.method
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max) if config.method == "ngram" else None
        self.draft = draft
        self.tokens: dict[str, array] = {}  # prompt + output of each speculating request
        self.control: dict[str, AdaptiveK] = {}
        # counters: proposed tokens, those accepted, verified rows (a row with proposals in a step), steps verified
        self.proposed = self.accepted = self.rows = self.steps = 0
        self.costs = StepCosts()  # the core times its steps into it

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt: list[int]) -> None:
        self.tokens[request_id] = array("I", prompt)
        self.control[request_id] = AdaptiveK(self.config.k)

    def drop(self, request_id: str) -> None:
        if self.tokens.pop(request_id, None) is not None:
            del self.control[request_id]
            if self.draft is not None:
                self.draft.drop(request_id)

    def record(self, outputs) -> None:
        """The tokens each output carries join its request's sequence; ended requests are forgotten."""
        for out in outputs:
            seq = self.tokens.get(out.request_id)
            if seq is None:
                continue
            if out.done:
                self.drop(out.request_id)
            elif out.token_ids:
                seq.extend(out.token_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tokens

    # ------------------------------------------------------------------ a step
    def propose(self, request_ids: list[str], limits: list[int],
                fill: Callable[[int], int] | None = None) -> list[list[int]]:
        """Proposals for these decoding requests (each at most its limit: room in the cache, tokens left to
        generate); [] for a request that does not speculate, is paused or has nothing to propose. `fill`: the
        tokens a pass verifying k takes at the same price (a compiled pass's padded width, less one)."""
        budgets = []
        for rid, limit in zip(request_ids, limits):
            c = self.control.get(rid)
            k = c.budget() if c is not None and limit > 0 else 0
            budgets.append(min(limit, fill(k) if fill is not None and k else k))
        if self.ngram is not None:
            return [self.ngram.propose(self.tokens[rid], k) if k > 0 else [] for rid, k in zip(request_ids, budgets)]
        out = self.draft.propose([(rid, self.tokens.get(rid), k) for rid, k in zip(request_ids, budgets)])
        for rid, k, p in zip(request_ids, budgets, out):
            if k > 0 and not p:  # the draft ran and was unsure of its first token: that pass was spent for nothing
                self.control[rid].observe(0, 0)
        return out

    def observe(self, request_id: str, proposed: int, accepted: int, extra: float | None = None) -> None:
        """`extra`: what the pass cost beyond a plain step, in plain steps (`StepCosts.extra`; None: not timed)."""
        self.proposed += proposed
        self.accepted += accepted
        self.rows += 1
        c = self.control.get(request_id)
        if c is not None:
            c.observe(proposed, accepted, extra)

    def stats(self) -> dict:
        return {"method": self.method, "k": self.config.k, "max_batch": self.config.max_batch,
                "proposed_tokens": self.proposed, "accepted_tokens": self.accepted, "verified_rows": self.rows,
                "verify_steps": self.steps, "pass_cost_in_steps": self.costs.as_dict(),
                "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None}
