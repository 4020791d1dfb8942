"""Next-token selection on the model's device, vectorized over the batch (the parameters it applies:
engine/params.py). One module per job, as vLLM V1's `vllm/v1/sample/`:

- `state`: `SlotState`, every slot's sampling state as tensors; `Kind`, what each slot's request needs.
- `plan`: `Plan`, the host-side view of one batch composition, cached per slot list (`Plans`).
- `sampler`: `Sampler`, the step (bias → penalties → temperature → mask → draw → top-p check → one read-back).
- `penalties`: logit bias, min_tokens, repetition, presence and frequency penalties.
- `draw`: the hierarchical layout (`Blocks`) and its draws: greedy, Gumbel-max, top-k.
- `top_p`: the nucleus membership check and the redraws of rejected rows.
- `noise`: the counter-based Gumbel noise.
- `bitmask`: grammar masks, unpacked and applied; rows whose allowed tokens underflowed recomputed.

`SlotState` keeps every request's sampling state as tensors indexed by KV-cache slot (temperature,
top-k, top-p, penalties, seed, the token history), written once when the request is admitted, so a
decode step builds nothing from Python lists; `Sampler` draws each step's tokens from it and reads back
one small tensor.

Randomness is counter-based, as in vLLM's GPU sampler (`vllm/v1/worker/gpu/sample/gumbel.py`):
the Gumbel noise of token t at step n of a request with seed s is a hash of (s, n, t). It belongs to
the token id, not to a rank or a batch row, so a seeded request gives the same tokens alone or in any
batch, and a filtered row needs noise only for its candidates. Sampling is exact (Gumbel-max:
argmax(z + G) is distributed as softmax(z)) and hierarchical, so no full vocabulary of noise is drawn:

    block b  ~ softmax over blocks of logsumexp(z[b])      (noise keyed by block id)
    token t  ~ softmax(z) within block b                   (noise keyed by token id)

which is softmax(z) exactly, since P(b) = Σ_{t∈b} p_t. The block sums are the full-vocabulary pass
that the log-probabilities need anyway; the noise is a few hundred hashes per row.

Order of logit processing (Hugging Face's and vLLM's): logit bias and min_tokens (EOS and stop token ids
at -inf until a request has min_tokens tokens) → penalties (repetition on prompt + output, presence and
frequency on output) → temperature → top-k → top-p. Temperature 0 is greedy argmax. Rows of a batch that
use none of these pay nothing for them: each is a flag of the slot's kind and of the batch's plan.
- top-k: `topk(max k)` over the batch and a per-row cut (TGI's heterogeneous top-k); no full sort.
- top-p, exact and sort-free, by rejection (FlashInfer's scheme): draw from the row's distribution;
  the token is in the nucleus iff the mass of strictly more likely tokens is < top_p, checked in one
  pass. The nucleus holds mass ≥ top_p, so a draw is accepted with probability ≥ top_p; a rejected
  draw raises a pivot (only tokens more likely than it can be in the nucleus) and the row is drawn
  again from above the pivot with fresh noise. The accepted token is distributed exactly as the
  renormalized nucleus. Rows whose first draw is rejected (probability ≤ 1 − top_p each) are
  finished after the step's read-back, on those rows only.

- grammar masks (structured output): a constrained row's exp(z − max z) is multiplied by its 0/1 mask
  before the block sums, so its draw, top-p and greedy choice see only allowed tokens while every
  other pass stays that of an unconstrained row; top-k rows take a masked copy of their logits.

Reported log-probabilities are under the model's own distribution (raw logits, temperature 1), as
TGI and OpenAI report them, whatever the sampling parameters were (a grammar's mask included).
"""

from engine.sampler.sampler import Sampler

__all__ = ["Sampler"]
