"""Errors the CLI turns into one line on stderr and an exit code (never a traceback)."""

from __future__ import annotations


class OgrpoError(Exception):
    """Bad input or an environment problem the user can fix. The message names the fix."""

    exit_code = 2


class ConfigError(OgrpoError):
    """One or more problems in a run config, collected and reported together."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.problems))


class NoFitError(OgrpoError):
    """The plan does not fit in memory (exit 3, distinct from bad input)."""

    exit_code = 3


class LaunchError(OgrpoError):
    """A role failed at run time (server died, health timeout, trainer crashed)."""

    exit_code = 1
