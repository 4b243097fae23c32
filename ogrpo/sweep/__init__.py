"""Sweeps: a grid of run configs (x seeds) planned like `ogrpo submit`, run as ONE Slurm job array (each task
one point's whole job) or one point after another here, followed and summarized together.

grid (points from --grid/--seeds), plan (plan every point, write its job directory), manifest (the sweep
directory and sweep.json), slurm (the array: render, submit, state, cancel), local (the sequential runner),
summary (summary.csv and the reward plot). Importing the package imports nothing heavy.
"""
