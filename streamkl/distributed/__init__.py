"""Context parallel: the KL of one long sequence whose tokens are sharded over a process group.

    out = streamkl.distributed.kl(q1, k1, q2, k2, causal=True)      # this rank's shards

`shard` cuts a full sequence into this rank's shard (the load-balanced layout for causal),
`gather` assembles shards back, `shard_indices` gives a shard's token positions. The design:
docs/distributed.md.
"""

from streamkl.distributed.api import kl
from streamkl.distributed.layout import gather, shard, shard_indices

__all__ = ["kl", "shard", "gather", "shard_indices"]
