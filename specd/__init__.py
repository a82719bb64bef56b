"""specd: speculative decoding for MLX language models, split into gRPC services."""

__version__ = "0.1.0"
