"""realign: plan, run and measure RLHF on GPU clusters (runtime, config, CLI).

Importing this package imports nothing heavy: torch and megatron-core are imported
by the modules that need them, so `realign plan` starts fast on a laptop.
"""
__version__ = "0.1.0"
