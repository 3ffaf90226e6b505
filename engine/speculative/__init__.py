"""Speculative decoding: a sequence's next tokens proposed without a second model, and verified in the batched step.

A decoding sequence whose request samples greedily (engine/sampler.py: plain_greedy, no structured output, no
logprobs) may carry a draft: tokens that the n-gram proposer (ngram.py) expects to follow, found where the
sequence's last few tokens occurred before in its prompt or output. The scheduler feeds the draft behind the
sequence's last token as one short chunk, with the sequence's own adapter, beside the other sequences' decodes and
prefills; the model's argmax at each row of that chunk says which draft tokens it would have produced itself. The
longest agreeing prefix is kept, and the model's own token after it is appended too, so a step yields between one
and len(draft) + 1 tokens, each exactly the token that decoding one step at a time gives. The K/V of rejected
draft tokens lies past the sequence's computed tokens, so the next step overwrites it, and the prefix cache keys
only computed blocks: it never holds a rejected token.

The package imports nothing itself: the engine's config reads config.py without torch (Serve's build step
validates a config), and the engine imports speculator.py.
"""
