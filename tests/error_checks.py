"""What every user-facing refusal must be: one error of O-GRPO's kind on one line, which the CLI prints as is
(no traceback, no multi-line dump)."""

from __future__ import annotations

import pytest

from ogrpo.errors import OgrpoError


def one_line_error(call, *args, error: type[OgrpoError] = OgrpoError, match: str | None = None) -> OgrpoError:
    """The ERROR that call(*args) raises (its text matching MATCH, when given), checked to be one line."""
    with pytest.raises(error, match=match) as info:
        call(*args)
    assert "\n" not in str(info.value)
    return info.value
