"""megagspo: GSPO reinforcement learning for Qwen3-style MoE models on Megatron-Core."""

__version__ = "0.1.0"
