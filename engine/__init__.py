"""mlx-engine: a multi-process LLM serving engine on MLX."""

__version__ = "0.1.0"
