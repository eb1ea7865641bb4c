"""mcpo-megatron: Megatron-scale reinforcement learning for reasoning LLMs (MCPO and its baselines)."""

__version__ = "0.1.0"
