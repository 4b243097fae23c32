"""Starlette: every app in the process answers through a guard, for `trl vllm-serve`, which has no middleware
option (the guard: ogrpo.serve.auth.JobKeyMiddleware, installed by ogrpo.serve.auth.install_starlette_guard).

Patched at `Starlette.__call__`, which FastAPI and every subclass end in (FastAPI overrides
`build_middleware_stack`, so that is not the place), whatever server runs the app.
"""

from __future__ import annotations

from ogrpo.patches.target import moved, require

NAME = "starlette_job_key"
LIBRARY = "starlette"


def check() -> None:
    require(NAME, LIBRARY, {"starlette.applications:Starlette.__call__": ("self", "scope", "receive", "send")})
    from starlette.applications import Starlette

    if "__call__" not in Starlette.__dict__:
        raise moved(NAME, LIBRARY, ["Starlette.__call__ is inherited, not Starlette's own (the guard wraps it)"])


def installed() -> bool:
    from starlette.applications import Starlette

    return bool(getattr(Starlette.__dict__.get("__call__"), "_ogrpo_job_key", False))


def install(guard) -> None:
    """`guard(asgi_app) -> asgi_app`, called once per app on its first request, around the app's own
    `Starlette.__call__`. Idempotent: the first guard installed stays."""
    check()  # a moved target raises here: fail loudly rather than serve unguarded
    from starlette.applications import Starlette

    original = Starlette.__dict__["__call__"]
    if getattr(original, "_ogrpo_job_key", False):
        return

    async def __call__(self, scope, receive, send):
        guarded = self.__dict__.get("_ogrpo_guard")
        if guarded is None:
            async def inner(scope, receive, send):
                await original(self, scope, receive, send)

            guarded = self.__dict__["_ogrpo_guard"] = guard(inner)
        await guarded(scope, receive, send)

    __call__._ogrpo_job_key = True
    Starlette.__call__ = __call__
