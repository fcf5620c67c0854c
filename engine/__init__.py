"""mlx-engine: a multi-process LLM serving engine on MLX."""

from engine import open_files

__version__ = "0.1.0"

# NOTE: before anything imports mlx-lm, whose `mlx_lm.utils` would lower the open-file limit
# (or fail to start where it is below 4,096): every engine process imports this package first.
open_files.keep_raised()
