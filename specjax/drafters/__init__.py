"""Proposers, one per file. Each is a pytree (weights as data, settings as static metadata) with

    init(prompt [B, P], prompt_len [B], num_slots) -> state
    propose(state, seqs, key, sampling) -> (draft [B, k] int32, draft_probs [B, k, V] | None, state)

`propose` reads the committed tokens in `seqs` (see decoding/sequences.py for the invariant) and must
be pure and jit-able. draft_probs is the distribution each draft was drawn from (None when the drafts
are deterministic, i.e. one-hot); greedy decoding ignores it.

Tree verification (decoding/tree.py) needs per-position draft scores instead, from one of

    block_logits(state, seqs) -> logits [B, k, V]      (block drafters: every position at once)
    propose_logits(state, seqs) -> (chain [B, k], logits [B, k, V], state)   (AR and n-gram
        drafters: their greedy chain and the scores along it)

Drafters work with dense and hybrid targets alike, except layer-skip (it shares a dense target's
layers).
"""
