"""Tensor parallelism over ``torch.distributed``: one executor across N ranks.

    group     the ranks' process groups and the collectives the model calls (custom ops,
              so graph capture and torch.compile see one opaque node each)
    sharding  which slice of each weight a rank holds; the per-rank model shape
    layers    vocab-parallel embedding and LM head
    protocol  the fixed-size header that precedes every step sent to the other ranks
    channel   rank 0 -> other ranks: steps (packed int64 buffers), sampled tokens, capture
    follower  the loop a rank other than 0 runs: receive a step, run the same forward
"""
