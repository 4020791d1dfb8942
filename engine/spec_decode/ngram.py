"""Prompt lookup (vLLM's `ngram` proposer, llama.cpp's `ngram-simple`): the sequence's last n tokens (n from
`max_n` down to `min_n`) found earlier in the sequence (prompt and output), and the tokens that followed the most
recent earlier occurrence are the proposal. It costs no model: a search over the request's tokens, in C
(bytes.rfind over the ids packed as 4-byte words)."""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int] | array, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        n_tok = len(tokens)
        if k < 1 or n_tok < self.min_n + 1:
            return []
        packed = tokens if isinstance(tokens, array) else array("I", tokens)
        data = packed.tobytes()
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = data[-4 * n:]
            end = len(data) - 4  # an occurrence ending before the sequence's last token (not the suffix itself)
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # aligned on a token, not straddling two
                    start = at // 4 + n
                    return list(packed[start:start + k])
                end = at + 4 * n - 1
        return []
