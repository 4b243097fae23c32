"""O-GRPO: fast, memory-bounded, reproducible GRPO post-training on on-prem Slurm clusters."""

__version__ = "0.1.0"
