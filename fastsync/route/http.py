"""An OpenAI-compatible HTTP front for ``vllm serve`` replicas, routing by version (aiohttp).

``POST /v1/completions`` and ``/v1/chat/completions`` are forwarded to the replica
:class:`~fastsync.route.router.VersionRouter` picks (the answer carries ``x-fastsync-replica``
and ``x-fastsync-version`` headers); an optional ``x-fastsync-min-version`` request header
raises the floor. With no replica on an allowed version the answer is ``503`` with a JSON body
naming the versions on offer, at once (no hang). An answer stamped with the weight versions that
generated it (each choice's ``weight_versions``, ``[{"version", "start", "end"}, ...]``, as vLLM's
token-in-token-out route gives them) is judged by the same
rule (:meth:`VersionRouter.judge`): ``x-fastsync-version`` is then the version of its last token,
``x-fastsync-versions`` lists every one, ``x-fastsync-stale: 1`` marks an answer with tokens from
below the floor. ``GET /health``: 200 when some replica may
answer, else 503. ``GET /version``: every replica's version and state. ``POST /fastsync/state``
(``{"name", "version"?, "state"?}``): what an update orchestrator reports. Binds to 127.0.0.1
by default.
"""

from __future__ import annotations

import asyncio
import threading

from fastsync.errors import ConfigError
from fastsync.route.router import NoReplicaError, VersionRouter

__all__ = ["RouterFront", "DEFAULT_HOST", "stamped_versions"]

DEFAULT_HOST = "127.0.0.1"
_FORWARD = ("/v1/completions", "/v1/chat/completions")


def stamped_versions(body: bytes) -> list[int]:
    """The weight versions an answer says generated it, in token order (the last is its last
    token's): each choice's ``weight_versions`` spans. [] when it carries none or is not JSON."""
    import json

    try:
        doc = json.loads(body)
        out = []
        for c in doc.get("choices") or []:
            for span in c.get("weight_versions") or []:
                out.append(int(span["version"]))
        return out
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


class RouterFront:
    """``RouterFront(router, {"r0": "http://127.0.0.1:8001", ...}).start()`` serves on a
    background thread (its own event loop); ``stop()`` ends it. ``port=0`` picks a free port."""

    def __init__(self, router: VersionRouter, replicas: dict[str, str], *, host: str = DEFAULT_HOST, port: int = 0,
                 timeout_s: float = 120.0) -> None:
        if not replicas:
            raise ConfigError("RouterFront needs at least one replica URL")
        self.router, self.replicas, self.host, self.port, self.timeout_s = router, dict(replicas), host, port, timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._thread: threading.Thread | None = None
        self.answered: list[tuple[str, int, int]] = []  # (replica, version, lowest allowed) per answer

    def app(self):  # type: ignore[no-untyped-def]
        from aiohttp import web

        app = web.Application()
        for path in _FORWARD:
            app.router.add_post(path, self._forward)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_post("/fastsync/state", self._state)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:  # type: ignore[no-untyped-def]
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _close(self, app) -> None:  # type: ignore[no-untyped-def]
        await self._session.close()

    async def _forward(self, request):  # type: ignore[no-untyped-def]
        from aiohttp import web

        raw = request.headers.get("x-fastsync-min-version")
        try:
            min_version = int(raw) if raw is not None else None
        except ValueError:
            return web.json_response({"error": {"message": f"x-fastsync-min-version {raw!r} is not an integer",
                                                "type": "invalid_request_error"}}, status=400)
        try:
            r = self.router.pick(min_version)
        except NoReplicaError as e:
            return web.json_response({"error": {"message": str(e), "type": "no_replica_for_version",
                                                "replicas": self.router.states()}}, status=503)
        url = self.replicas.get(r.name)
        try:
            if url is None:
                return web.json_response({"error": {"message": f"replica {r.name!r} has no URL",
                                                    "type": "router_error"}}, status=502)
            body = await request.read()
            async with self._session.post(url + request.path, data=body,
                                          headers={"content-type": request.headers.get("content-type",
                                                                                       "application/json")}) as resp:
                data = await resp.read()
                headers = {"x-fastsync-replica": r.name, "x-fastsync-version": str(r.version)}
                stamp = stamped_versions(data)
                if stamp:
                    if not self.router.judge(r.name, stamp, r.floor):
                        headers["x-fastsync-stale"] = "1"
                    headers["x-fastsync-version"] = str(stamp[-1])
                    headers["x-fastsync-versions"] = ",".join(str(v) for v in sorted(set(stamp)))
                self.answered.append((r.name, int(headers["x-fastsync-version"]), r.floor))
                return web.Response(body=data, status=resp.status, content_type="application/json",
                                    headers=headers)
        except Exception as e:  # a replica that died mid-request: 502 naming it
            return web.json_response({"error": {"message": f"replica {r.name!r} failed: {type(e).__name__}: {e}",
                                                "type": "replica_error"}}, status=502)
        finally:
            self.router.done(r.name)

    async def _health(self, request):  # type: ignore[no-untyped-def]
        from aiohttp import web

        ok = bool(self.router.eligible())
        return web.json_response({"ok": ok, "newest": self.router.newest()}, status=200 if ok else 503)

    async def _version(self, request):  # type: ignore[no-untyped-def]
        from aiohttp import web

        return web.json_response({"newest": self.router.newest(), "max_staleness": self.router.max_staleness,
                                  "replicas": self.router.states()})

    async def _state(self, request):  # type: ignore[no-untyped-def]
        from aiohttp import web

        try:
            body = await request.json()
            self.router.set_state(str(body["name"]), version=body.get("version"), state=body.get("state"))
        except (KeyError, ValueError, TypeError, ConfigError) as e:
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=400)
        return web.json_response({"ok": True})

    # ---- lifecycle on a background thread ------------------------------------------------------
    def start(self) -> "RouterFront":
        from aiohttp import web

        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._runner = web.AppRunner(self.app())
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.host, self.port)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:
                failure.append(e)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="fastsync-router", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise ConfigError("router front did not start within 30 s")
        if failure:
            raise ConfigError(f"router front cannot bind {self.host}:{self.port}: {failure[0]}")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._thread = None
