"""Prompt log-probabilities (`EngineRequest.prompt_logprobs`): the engine core's scoring step.

They are computed during prefill, chunk by chunk: the chunk's final hidden states go through the output head a
piece of rows at a time (`PROMPT_LOGPROBS_PIECE` logits at most), so no prompt × vocabulary tensor ever exists
(vLLM #5907 and #38830 are out-of-memory reports of that). Each piece leaves only the token's log-probability, its
rank and the top-n alternatives on the device; they are read back once, with the request's first output.

    scorer = PromptScorer(vocab_size)
    scorer.add(request_id, top_n)                      # a request that asked, when the core accepts it
    scorer.score(chunk, h, rows, model.head, history)  # each prefill chunk that holds such requests
    scorer.drop(request_id)                            # an aborted request
    outputs = scorer.attach(outputs)                   # every batch of outputs leaving the core
"""

from __future__ import annotations

import torch

from engine.request import PromptLogprobs, RequestOutput

# logits computed at once for prompt log-probabilities: 2M (8 MB in fp32; GPT-2's vocabulary in 41-row pieces). A
# piece's temporaries (the logits, their fp32 copy, logsumexp's, the rank comparison) stay under ~24 MB, inside the
# 4 MiB-per-slot allowance the server's KV-cache sizing leaves beside the cache at its smallest batch (8 slots)
PROMPT_LOGPROBS_PIECE = 1 << 21


class PromptScorer:
    """The prompt log-probabilities of the requests that asked for them, from admission to their first output.

    `in` and `len` tell which requests are still held (scored in part or waiting for their first output)."""

    def __init__(self, vocab_size: int, piece: int = PROMPT_LOGPROBS_PIECE) -> None:
        self.vocab_size = vocab_size
        self.piece = piece  # logits computed at once
        # per request id: (top n, device tensors per chunk piece)
        self._pending: dict[str, tuple[int, list[tuple]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, top_n: int) -> None:
        """Hold the scores of a request that asked for its prompt's log-probabilities and `top_n` alternatives."""
        self._pending[request_id] = (min(top_n, self.vocab_size), [])

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted); nothing if it holds none."""
        self._pending.pop(request_id, None)

    def score(self, chunk, h: torch.Tensor, rows: list[int], head, history: torch.Tensor) -> None:
        """Prompt log-probabilities from a chunk's hidden states h (B, n, C), for the chunk's requests at `rows`:
        position p predicts prompt token p + 1, so this chunk scores tokens start+1 .. start+n (those inside the
        prompt). `head` maps hidden states to logits; `history` holds each slot's tokens (the sampler's)."""
        V = self.vocab_size
        piece = max(1, self.piece // max(V, 1))
        for b in rows:
            r = chunk.reqs[b]
            m = min(chunk.n, r.prompt_len - 1 - chunk.start)  # predicted tokens that are prompt tokens
            if m <= 0:
                continue
            k, parts = self._pending[r.id]
            targets = history[r.slot, chunk.start + 1:chunk.start + 1 + m]
            for p0 in range(0, m, piece):
                logits = head(h[b, p0:p0 + piece][: m - p0]).float()[:, :V]
                lse = torch.logsumexp(logits, -1)
                target = logits.gather(1, targets[p0:p0 + piece, None])  # (P, 1)
                rank = (logits > target).sum(-1) + 1
                lp = target[:, 0] - lse
                if k:
                    vals, ids = logits.topk(k, -1)
                    parts.append((lp, rank, ids, vals - lse[:, None]))
                else:
                    parts.append((lp, rank, None, None))

    def attach(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand each request's prompt log-probabilities to its first output (one read-back); drop those of
        requests that ended with an error."""
        if not self._pending:
            return outputs
        for out in outputs:
            entry = self._pending.pop(out.request_id, None)
            if entry is None or out.error is not None:
                continue
            k, parts = entry
            table = []
            if parts:
                cols = [torch.cat([p[i] for p in parts]).double()[:, None] for i in (0, 1)]
                if k:
                    cols += [torch.cat([p[3] for p in parts]).double(), torch.cat([p[2] for p in parts]).double()]
                table = torch.cat(cols, 1).tolist()  # the one device→host copy
            out.prompt_logprobs = PromptLogprobs(
                [None] + [row[0] for row in table], [None] + [int(row[1]) for row in table],
                [[]] + [[(int(i), v) for v, i in zip(row[2:2 + k], row[2 + k:])] for row in table] if k else None)
        return outputs
