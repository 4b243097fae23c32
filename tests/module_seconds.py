"""`python tests/module_seconds.py JUNIT.xml... > tests/module_seconds.json`: each test module's seconds in a run's
JUnit report (`make test` writes build/junit-main.xml), for tests/conftest.py to hand the modules out to the
pytest-xdist workers longest first. Refresh it when modules grow or new slow ones come; a module missing from it
just goes last."""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET


def module_seconds(paths: list[str]) -> dict[str, int]:
    seconds: collections.Counter = collections.Counter()
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            seconds[module] += float(case.get("time") or 0.0)
    return {m: round(s) for m, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])) if round(s) > 0}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.splitlines()[0])
    print(json.dumps(module_seconds(sys.argv[1:]), indent=1))
