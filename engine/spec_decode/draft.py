"""Draft-model proposals (`DraftProposer`): a smaller checkpoint with the target's tokenizer decodes greedily, in a
KV cache of its own, the next k tokens of each speculating request (vLLM's draft model, llama.cpp's
--model-draft, gpt-fast's draft_model).

The draft's slots follow request ids, not the target's slots (those move to keep the decoding batch contiguous).
Each slot remembers the tokens it holds: the request's sequence as of its last proposal plus the proposals fed
after it; the next proposal keeps the common prefix with the sequence now and feeds only what differs (the
tokens accepted since, and the target's own last token), so a draft prefills a prompt once and then runs about
k + 1 positions per step.
"""

from __future__ import annotations

import torch

from model.kv_cache import KVCache, device_index


class DraftError(ValueError):
    """A draft model that cannot serve this target (another tokenizer or vocabulary); one line."""


def check_draft(target_tokenizer, draft_tokenizer, draft_name: str = "the draft model") -> None:
    """DraftError unless the two tokenizers map every id to the same bytes and name the same special tokens."""
    a, b = target_tokenizer, draft_tokenizer
    if a.vocab_size != b.vocab_size:
        raise DraftError(f"{draft_name} has a vocabulary of {b.vocab_size} tokens, the served model {a.vocab_size}: "
                         "speculative decoding needs the same tokenizer")
    if a.special_tokens != b.special_tokens or any(a.token_bytes(i) != b.token_bytes(i)
                                                   for i in range(a.vocab_size) if i not in a.special_tokens.values()):
        raise DraftError(f"{draft_name} has another tokenizer than the served model (same size, other tokens): "
                         "speculative decoding needs the same tokenizer")


class DraftProposer:
    def __init__(self, model, n_slots: int, vocab_size: int, max_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, p_min: float = 0.0) -> None:
        self.model = model
        # a draft token the draft itself gives less than p_min ends the proposal there (llama.cpp's --draft-p-min):
        # an unsure draft is mostly wrong, and each wrong token costs a draft pass and a verification position
        self.p_min = p_min
        param = next(model.parameters())
        self.device = param.device
        self.vocab_size = vocab_size  # proposals are ids of the target's vocabulary (a padded draft head is cut)
        self.max_len = min(max_len or model.config.block_size, model.config.block_size)
        self.cache = KVCache(model.config, n_slots, self.max_len, dtype=kv_dtype or param.dtype, device=self.device)
        self.free = list(range(n_slots))
        self.slot: dict[str, int] = {}
        self.base: dict[str, int] = {}  # how many of the request's tokens the slot held at its last proposal
        self.fed: dict[str, list[int]] = {}  # the proposals fed after them
        self.forward_passes = 0

    def drop(self, request_id: str) -> None:
        slot = self.slot.pop(request_id, None)
        if slot is not None:
            self.cache.reset(slot)
            self.free.append(slot)
            del self.base[request_id], self.fed[request_id]

    @torch.inference_mode()
    def propose(self, rows: list[tuple[str, object, int]]) -> list[list[int]]:
        """rows: (request id, its tokens so far, k) → up to k greedy draft tokens each."""
        out: list[list[int]] = [[] for _ in rows]
        want = [0] * len(rows)
        live: list[int] = []
        for i, (rid, tokens, k) in enumerate(rows):
            n = len(tokens) if tokens is not None else 0
            k = min(k, self.max_len - n)  # the slot holds the sequence and all but the last proposal
            if k < 1 or n < 1:
                continue
            slot = self._slot(rid)
            if slot is None:
                continue
            held = self._held(rid, tokens)
            held = min(held, n - 1)  # the last token is always fed: its logits give the first proposal
            self.cache.truncate(slot, held)
            idx = device_index([list(tokens[held:])], self.device)
            logits = self.model.forward_cached(idx, self.cache, [slot])
            self.forward_passes += 1
            self.base[rid], self.fed[rid] = n, []
            (t,), (sure,) = self._pick(logits)
            if sure:
                out[i].append(t)
                want[i] = k
                live.append(i)
        while True:  # the rest greedily, one batched pass per position over the requests still short
            live = [i for i in live if len(out[i]) < want[i]]
            if not live:
                return out
            slots = [self.slot[rows[i][0]] for i in live]
            idx = device_index([[out[i][-1]] for i in live], self.device)
            logits = self.model.forward_cached(idx, self.cache, slots)
            self.forward_passes += 1
            tokens, sure = self._pick(logits)
            for i, t, ok in zip(live, tokens, sure):
                self.fed[rows[i][0]].append(out[i][-1])
                if ok:
                    out[i].append(t)
                else:
                    want[i] = len(out[i])  # unsure: the proposal ends here

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """The draft's greedy token of each row, and whether it gives it at least p_min."""
        z = logits[:, :self.vocab_size].float()
        top, tok = z.max(-1)
        p = torch.exp(top - torch.logsumexp(z, -1))
        return tok.tolist(), (p >= self.p_min).tolist()

    def _slot(self, rid: str) -> int | None:
        slot = self.slot.get(rid)
        if slot is None and self.free:
            slot = self.slot[rid] = self.free.pop()
            self.cache.reset(slot)
            self.base[rid], self.fed[rid] = 0, []
        return slot

    def _held(self, rid: str, tokens) -> int:
        """How many of `tokens` the slot holds: its earlier sequence, then the fed proposals that came true."""
        base, fed = self.base[rid], self.fed[rid]
        n = base
        for t in fed:
            if n >= len(tokens) or tokens[n] != t:
                break
            n += 1
        return n


def load_draft(path: str, target_tokenizer, device=None, dtype: torch.dtype | None = None):
    """The draft checkpoint's model, on the target's device and dtype; DraftError (one line) when it cannot be
    loaded or has another tokenizer."""
    from model.checkpoint import CheckpointError, load_checkpoint

    try:
        ck = load_checkpoint(path, device=device or "cpu", dtype=dtype)
    except (CheckpointError, OSError, ValueError) as e:
        raise DraftError(f"cannot load the draft model {path}: {e}") from None
    check_draft(target_tokenizer, ck.tokenizer, f"the draft model {path}")
    return ck.model
