"""The code sandbox that model-written programs run in: the trainer's pool (`pool.py`), the launcher that runs
inside each run's namespaces (`launcher.py`), its seccomp and Landlock filters, the work-dir cleaner, and the
run's policy (`ogrpo.sandbox: auto | none`).

Nothing is imported here: the launcher starts as `python -m ogrpo.sandbox.launcher`, which runs this file first,
and must load only the standard library.
"""
