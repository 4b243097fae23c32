"""typer: keep option parsing from importing pydantic (0.1-0.2 s of the 0.3 s `ogrpo plan` may take).

typer 0.29 coerces every non-flag option through a pydantic TypeAdapter. Options typed plain str/int/float/bool
(or Optional of them) need no pydantic: coerce those directly and leave every other annotation to typer.
`check()` fails loudly when typer's internals moved; `install()` then leaves typer untouched and says so on
stderr (the CLI is only slower, never wrong), and `ogrpo doctor` and tests/test_patches.py fail.
"""

from __future__ import annotations

import sys

from ogrpo.patches.target import PatchTargetMoved, require

NAME = "typer_options"
LIBRARY = "typer"
# typer internals this patch subclasses or wraps, with the parameters it relies on
TARGETS = {
    "typer.core:_TyperParameter.get_runtime_param": ("self",),
    "typer._coercion:RuntimeParam": ("parameter_info", "annotation"),
    "typer._coercion:RuntimeParam._coerce_value": ("value", "param", "ctx"),
    "typer._click.exceptions:BadParameter": None,
}


def check() -> None:
    require(NAME, LIBRARY, TARGETS)


def install() -> None:
    import typing
    from dataclasses import dataclass

    try:
        check()
    except PatchTargetMoved as exc:
        print(f"ogrpo: warning: {exc}; options are parsed by typer itself (slower start)", file=sys.stderr)
        return
    from typer import core
    from typer._click.exceptions import BadParameter
    from typer._coercion import RuntimeParam

    original = core._TyperParameter.get_runtime_param
    if getattr(original, "_ogrpo_plain", False):
        return

    @dataclass(frozen=True)
    class PlainParam(RuntimeParam):
        base: type = str

        def _coerce_value(self, value, param, ctx):
            if self.base is bool:
                if isinstance(value, bool):
                    return value
                word = str(value).strip().lower()
                if word in ("1", "true", "t", "yes", "y", "on"):
                    return True
                if word in ("0", "false", "f", "no", "n", "off"):
                    return False
                raise BadParameter(f"{value!r} is not a valid boolean.", ctx=ctx, param=param)
            if isinstance(value, self.base) and not isinstance(value, bool):
                return value
            try:
                return self.base(value)
            except (TypeError, ValueError):
                kind = {int: "integer", float: "number"}.get(self.base, self.base.__name__)
                raise BadParameter(f"{value!r} is not a valid {kind}.", ctx=ctx, param=param) from None

    def plain_type(annotation):
        if annotation in (str, int, float, bool):
            return annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
                and len(args) == 1 and args[0] in (str, int, float, bool):
            return args[0]
        return None

    def get_runtime_param(self):
        if self._runtime_param is None:
            desc = self.type_descriptor
            base = plain_type(desc.annotation)
            if base is not None and desc.file_annotation is None and getattr(desc.parameter_info, "parser",
                                                                               None) is None:
                self._runtime_param = PlainParam(parameter_info=desc.parameter_info, annotation=desc.annotation,
                                                 base=base)
        return original(self)

    get_runtime_param._ogrpo_plain = True
    core._TyperParameter.get_runtime_param = get_runtime_param
