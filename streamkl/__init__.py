"""streamkl: fused, streaming KL divergence between two attention distributions."""

from streamkl import autograd as _autograd  # noqa: F401  (registers the torch.library ops)
from streamkl import distributed, reference, varlen
from streamkl._version import __version__
from streamkl.api import kl
from streamkl.dispatch import available_backends
from streamkl.indexer import indexer_kl
from streamkl.sparse.block_mask import BlockMask

__all__ = ["kl", "indexer_kl", "BlockMask", "available_backends", "distributed", "varlen", "reference", "__version__"]
