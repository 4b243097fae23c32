"""O-GRPO's GRPO trainer: one subclass of TRL's GRPOTrainer (grpo.py) composed of one layer per concern, and the
check that TRL still has every method it overrides (overrides.py). Importing this package imports no library."""
