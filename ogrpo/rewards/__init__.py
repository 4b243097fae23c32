"""Reward functions: the registry that names them (`registry.py`: `check_rewards` at plan time, `resolve_rewards`
in the trainer), text, math and code rewards, the format scanners, and the bounded worker pool math runs in.

Nothing is imported here: `ogrpo plan` reads the registry without loading any implementation.
"""
