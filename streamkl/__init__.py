"""streamkl: fused, streaming KL divergence between two attention distributions."""

from streamkl import autograd as _autograd  # noqa: F401  (registers the torch.library ops)
from streamkl.api import kl
from streamkl.dispatch import available_backends
from streamkl.indexer import indexer_kl
from streamkl.sparse.block_mask import BlockMask

__version__ = "0.1.0"

__all__ = ["kl", "indexer_kl", "BlockMask", "available_backends", "__version__"]
