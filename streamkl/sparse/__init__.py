"""Block-sparse masks and the tile schedule every backend walks."""
