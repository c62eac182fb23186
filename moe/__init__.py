"""moe: the Mixture-of-Experts model library on Megatron-Core (Qwen3-MoE builder, HF checkpoint
conversion, routing replay, the CPU platform shim). It never imports `megagspo`."""

__version__ = "0.1.0"
