"""Version-aware routing and rolling updates through the real aiohttp front.

The replicas here are small aiohttp servers answering ``/v1/completions`` with the version their
weights are at: STAND-INS for ``vllm serve``, fast enough to run many requests per wave (the
same rolling update with two real ``vllm serve`` replicas is ``test_router_vllm_serve.py``).
Requests flow on a thread during a rolling update;
every answer's replica and version is counted.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from fastsync.errors import ConfigError, SyncError
from fastsync.route.http import RouterFront
from fastsync.route.rolling import RollingUpdate
from fastsync.route.router import NoReplicaError, VersionRouter


class StandInReplica:
    """A stand-in for one ``vllm serve`` replica: answers with the version its weights hold."""

    def __init__(self, name: str) -> None:
        from aiohttp import web

        self.name, self.version, self.updating = name, 1, False

        async def completions(request):
            assert not self.updating, f"{self.name} answered while updating"
            return web.json_response({"object": "text_completion", "model": self.name,
                                      "choices": [{"text": f"v{self.version}"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        import asyncio

        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._runner = runner
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def update(self, version: int) -> None:
        self.updating = True
        time.sleep(0.3)  # the weight write
        self.version = version
        self.updating = False

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture
def cluster():
    reps = {n: StandInReplica(n) for n in ("r0", "r1")}
    router = VersionRouter(max_staleness=0)
    for n in reps:
        router.set_state(n, version=1)
    front = RouterFront(router, {n: f"http://127.0.0.1:{r.port}" for n, r in reps.items()}).start()
    yield reps, router, front
    front.stop()
    for r in reps.values():
        r.stop()


def test_rolling_update_keeps_one_replica_serving_and_no_stale_answer(cluster):
    reps, router, front = cluster
    assert front.host == "127.0.0.1"
    answers: list[tuple[str, int, str]] = []
    errors: list[int] = []
    stop = threading.Event()

    def flow() -> None:
        while not stop.is_set():
            code, body, hdr = _post(front.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            if code == 200:
                answers.append((hdr["x-fastsync-replica"], int(hdr["x-fastsync-version"]), body["choices"][0]["text"]))
            else:
                errors.append(code)

    th = threading.Thread(target=flow, daemon=True)
    th.start()
    time.sleep(0.2)
    roll = RollingUpdate(router, ["r0", "r1"], lambda n, v: reps[n].update(v), mode="rolling", fraction=0.5)
    t0 = len(answers)
    assert roll.run(2) == [["r0"], ["r1"]]
    during = answers[t0:]
    time.sleep(0.2)
    stop.set()
    th.join(10)
    # answered throughout: no 503 during the update, and requests were answered during each wave
    assert not errors, errors
    assert len(during) >= 4, during
    # staleness 0: once r0 serves v2, v1 answers stop; every answer's version is what the replica held
    for name, version, text in answers:
        assert text == f"v{version}", (name, version, text)
    first_v2 = next(i for i, a in enumerate(answers) if a[1] == 2)
    stale = [a for a in answers[first_v2:] if a[1] < 2]
    assert not stale, stale
    assert {a[0] for a in during} == {"r0", "r1"}
    with urllib.request.urlopen(front.url + "/version", timeout=5) as r:
        got = json.loads(r.read())
    assert got["newest"] == 2 and {x["version"] for x in got["replicas"]} == {2}


def test_no_replica_on_the_version_is_a_503_not_a_hang(cluster):
    reps, router, front = cluster
    t0 = time.monotonic()
    req = urllib.request.Request(front.url + "/v1/completions", data=b"{}", headers={"x-fastsync-min-version": "9"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 503 and time.monotonic() - t0 < 5
    err = json.loads(ei.value.read())["error"]
    assert err["type"] == "no_replica_for_version" and "version >= 9" in err["message"]
    for n in reps:
        router.set_state(n, state="updating")
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(front.url + "/health", timeout=5)
    assert ei.value.code == 503


def test_router_component_rules():
    r = VersionRouter(max_staleness=1)
    with pytest.raises(NoReplicaError, match="replicas: none"):
        r.pick()
    r.set_state("a", version=3)
    r.set_state("b", version=2)
    r.set_state("c", version=1)
    assert {x.name for x in r.eligible()} == {"a", "b"}
    picks = [r.pick().name for _ in range(4)]
    assert set(picks) == {"a", "b"}  # spread by in-flight count
    with pytest.raises(ConfigError, match="unknown state"):
        r.set_state("a", state="sleeping")
    with pytest.raises(ConfigError, match="max_staleness"):
        VersionRouter(max_staleness=-1)


def test_stop_the_world_is_default_and_failures_are_named():
    router = VersionRouter()
    for n in ("a", "b", "c"):
        router.set_state(n, version=1)

    def update(name, v):
        if name == "b":
            raise SyncError("b: trainer rank 1 died")

    roll = RollingUpdate(router, ["a", "b", "c"], update)
    assert roll.waves() == [["a", "b", "c"]]
    with pytest.raises(SyncError, match="'b'"):
        roll.run(2)
    assert {s["name"]: s["version"] for s in router.states()} == {"a": 2, "b": 1, "c": 2}
    assert RollingUpdate(router, ["a", "b", "c"], update, mode="rolling", fraction=1.0).waves() == [["a", "b"], ["c"]]


def test_stamped_answers_are_judged_by_the_versions_that_made_them():
    """A replica that flipped while the request ran (pause mode keep) answers with two versions:
    the router reports the last as ``x-fastsync-version``, all in ``x-fastsync-versions``, raises
    the replica's version from the stamp, and marks an answer with tokens below the floor stale."""
    import asyncio

    from aiohttp import web

    stamp = {"spans": [{"version": 1, "start": 0, "end": 5}, {"version": 2, "start": 5, "end": 9}]}

    async def completions(request):
        return web.json_response({"choices": [{"text": "x", "weight_versions": stamp["spans"]}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    router = VersionRouter(max_staleness=0)
    router.set_state("r0", version=1)
    front = RouterFront(router, {"r0": f"http://127.0.0.1:{port}"}).start()
    try:
        status, body, headers = _post(front.url + "/v1/completions", {"prompt": "a"})
        assert status == 200 and body["choices"][0]["weight_versions"] == stamp["spans"]  # forwarded unchanged
        assert headers["x-fastsync-version"] == "2" and headers["x-fastsync-versions"] == "1,2"
        assert "x-fastsync-stale" not in headers  # routed under floor 1: every token is >= 1
        assert router.states()[0]["version"] == 2  # the stamp says r0 flipped
        status, body, headers = _post(front.url + "/v1/completions", {"prompt": "b"})  # routed under floor 2
        assert headers.get("x-fastsync-stale") == "1" and router.stale_answers == {"r0": 1}
        stamp["spans"] = [{"version": 2, "start": 0, "end": 9}]
        status, body, headers = _post(front.url + "/v1/completions", {"prompt": "c"})
        assert "x-fastsync-stale" not in headers and headers["x-fastsync-versions"] == "2"
    finally:
        front.stop()
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
