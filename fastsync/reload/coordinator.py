"""Peer reload, host side: plan a joining engine against live holders and fill it.

A joining engine (started with ``load_format="dummy"``: it reads no checkpoint) announces itself
by calling :meth:`PeerReload.reload` with its handle and the candidate holders. In order:

1. the joining engine describes its workers' engine tensors (its layout);
2. each candidate holder is asked its version and whether it holds plain copies; a holder on
   another version, or without plain copies, or that does not answer, is refused (named in
   ``report.refused``): versions are never mixed;
   Trainer ranks hold versions too (:class:`fastsync.reload.holders.TrainerHolder`): their
   layout is the source as it is;
3. up to ``max_holders`` of the rest are chosen, least used first (each reload spreads over the
   holders that served the fewest so far; the planner then spreads bytes over their ranks);
4. the plan comes from the :class:`PlanCache` (per source and target layout hash);
5. the joining engine connects (its own control-plane namespace per attempt) and waits; each
   holder's workers write their share with NIXL straight into its parameters' memory;
6. if a holder fails (dies, refuses), the joining engine is told at once (the holder's ``done``
   key is set to an error, so it stops waiting), rolls back, and the next attempt goes to the
   remaining holders; when none is left it loads ``checkpoint`` (if given) with vLLM's own
   loader. ``report.source`` says which ("peer" or "checkpoint"), ``report.attempts`` why.

Handles (duck-typed; :class:`fastsync.engines.vllm.reload_host.VllmReloadEngine` is one):
``name``, ``reload_describe()``, ``reload_send(plan_json, options)``,
``reload_receive(plan_json, options)``, ``load_checkpoint(model_dir, version)``, and optionally
``alive()`` (False once the holder's process is gone: watched while the joining engine waits).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastsync.errors import ConfigError, SyncError
from fastsync.layout.wire import engine_tensors_from_json
from fastsync.reload.plans import PlanCache
from fastsync.layout.types import TrainerLayout
from fastsync.reload.source import HolderRanks, engine_source_layout, merge_sources, params_of, target_layout
from fastsync.sync.handshake import sender_done_key

__all__ = ["PeerReload", "ReloadReport"]

_HANDSHAKE_VERSION = 1  # each attempt has its own namespace, so its handshake number can be 1


@dataclass(slots=True)
class ReloadReport:
    """What one reload did. ``source``: "peer" or "checkpoint"; ``holders``: the holders that
    filled it; ``refused``: holder -> why it was not used; ``attempts``: one dict per attempt."""

    version: int
    source: str = ""
    holders: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    attempts: list[dict] = field(default_factory=list)
    plan_cached: bool = False
    plan_s: float = 0.0
    weights_s: float = 0.0
    registration: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class PeerReload:
    """Fills joining engines from live holders (see the module docstring).

    ``control`` is the coordinator's control plane (a ``TCPStoreControl`` server or client);
    its ``port`` is what the engines' workers connect to.
    """

    def __init__(self, control: Any, *, cache: PlanCache | None = None, timeout_s: float = 60.0,
                 max_holders: int = 2) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"PeerReload timeout_s must be positive, got {timeout_s}")
        if max_holders < 1:
            raise ConfigError(f"PeerReload max_holders must be >= 1, got {max_holders}")
        self.control = control
        self.cache = cache if cache is not None else PlanCache()
        self.timeout_s = timeout_s
        self.max_holders = max_holders
        self.served: dict[str, int] = {}
        self._seq = itertools.count(1)

    def reload(self, joiner: Any, holders: list[Any], version: int, *, checkpoint: str | None = None,
               on_attempt: Callable[[int, list[Any]], None] | None = None) -> ReloadReport:
        """Fill ``joiner`` with ``version`` from ``holders`` (or ``checkpoint`` when none can).
        ``on_attempt(attempt, chosen)`` runs after the joining engine started waiting and before
        the holders send (observers and fault-injection tests). Raises SyncError when neither a
        holder nor a checkpoint filled it; the joining engine then serves what it had."""
        report = ReloadReport(version)
        t0 = time.perf_counter()
        target = target_layout([engine_tensors_from_json(w["tensors"]) for w in joiner.reload_describe()],
                               description=f"joining engine {joiner.name}")
        params = params_of(target.tensors)
        live: list[tuple[Any, HolderRanks | TrainerLayout]] = []
        for h in holders:
            if hasattr(h, "source_layout"):  # trainer ranks (fastsync.reload.holders.TrainerHolder)
                if h.version != version:
                    report.refused[h.name] = f"holds version {h.version}, not {version}"
                else:
                    live.append((h, h.source_layout()))
                continue
            try:
                got = h.reload_describe()
            except Exception as e:
                report.refused[h.name] = f"did not answer ({type(e).__name__}: {e})"
                continue
            versions = {int(w["version"]) for w in got}
            if versions != {version}:
                report.refused[h.name] = f"serves version {sorted(versions)}, not {version}"
            elif not all(w.get("plain") for w in got):
                report.refused[h.name] = "holds no plain copy of its prepacked weights"
            else:
                live.append((h, HolderRanks(h.name, tuple(engine_tensors_from_json(w["tensors"]) for w in got))))
        seq = next(self._seq)
        for attempt in itertools.count(1):
            if not live:
                break
            chosen = sorted(live, key=lambda hr: self.served.get(hr[0].name, 0))[: self.max_holders]
            ok, failed = self._attempt(seq, attempt, joiner, chosen, params, target, version, report, on_attempt)
            if ok:
                report.source, report.holders = "peer", [h.name for h, _ in chosen]
                for h, _ in chosen:
                    self.served[h.name] = self.served.get(h.name, 0) + 1
                report.weights_s = time.perf_counter() - t0
                return report
            if not failed:  # the joining engine failed with every holder answering: no point retrying them
                break
            live = [hr for hr in live if hr[0].name not in failed]
        if checkpoint is None:
            raise SyncError(f"peer reload of {joiner.name} to version {version} failed and no checkpoint was given: "
                            f"refused {report.refused}; attempts {report.attempts}")
        t1 = time.perf_counter()
        got = joiner.load_checkpoint(checkpoint, version)
        report.attempts.append({"source": "checkpoint", "ok": True, "seconds": time.perf_counter() - t1,
                                "workers": got})
        report.source = "checkpoint"
        report.weights_s = time.perf_counter() - t0
        return report

    def _attempt(self, seq: int, attempt: int, joiner: Any, chosen: list[tuple[Any, HolderRanks | TrainerLayout]], params: dict,
                 target: Any, version: int, report: ReloadReport,
                 on_attempt: Callable[[int, list[Any]], None] | None) -> tuple[bool, set[str]]:
        hit_before = self.cache.hits
        source = merge_sources([hr if isinstance(hr, TrainerLayout) else engine_source_layout([hr], params)
                                for _, hr in chosen], params)
        plan = self.cache.get(params, source, target)
        report.plan_cached = self.cache.hits > hit_before
        report.plan_s += self.cache.last_plan_s
        plan_json = plan.dumps()
        prefix = f"reload/{seq}/{attempt}"
        ctl = self.control.with_prefix(prefix)
        base = {"control_port": self.control.port, "control_prefix": prefix, "handshake_version": _HANDSHAKE_VERSION,
                "weight_version": version, "timeout_s": self.timeout_s}
        host = getattr(self.control, "host", None)
        if host:  # the store's address, as the engines' workers reach it (another host on a cluster)
            base["control_host"] = host
        secret = getattr(self.control, "secret", None)
        if secret:  # the job secret: the workers' store clients and NIXL notifications need it
            base["control_secret"] = secret.hex()
        results: dict[str, Any] = {}
        failed: set[str] = set()

        def run(key: str, fn: Callable[[], Any], on_fail: Callable[[BaseException], None] | None = None) -> None:
            try:
                results[key] = fn()
            except BaseException as e:
                results[key] = e
                if on_fail is not None:
                    on_fail(e)

        t0 = time.perf_counter()
        jt = threading.Thread(target=run, args=("joiner", lambda: joiner.reload_receive(plan_json, dict(base))),
                              daemon=True)
        jt.start()
        if on_attempt is not None:
            on_attempt(attempt, [h for h, _ in chosen])
        threads = []
        holder_fail: dict[str, Callable[[BaseException], None]] = {}
        offset = 0
        for h, hr in chosen:
            width = hr.world_size if isinstance(hr, TrainerLayout) else len(hr.tensors)
            ranks = list(range(offset, offset + width))

            def fail(e: BaseException, h=h, ranks=ranks) -> None:
                for r in ranks:  # the joining engine stops waiting for this holder at once
                    ctl.set(sender_done_key(r, _HANDSHAKE_VERSION), f"err:holder {h.name} failed: {type(e).__name__}: {e}")

            holder_fail[h.name] = fail
            opts = {**base, "rank_offset": offset}
            th = threading.Thread(target=run, args=(h.name, lambda h=h, opts=opts: h.reload_send(plan_json, opts), fail),
                                  daemon=True)
            th.start()
            threads.append(th)
            offset += width
        # watchdog: a holder whose process died is failed at once (its RPC may never return), so
        # the joining engine stops waiting for it instead of running into its deadline
        deadline = time.monotonic() + self.timeout_s + 30
        dead: set[str] = set()
        while jt.is_alive() and time.monotonic() < deadline:
            jt.join(0.2)
            for (h, _), th in zip(chosen, threads):
                alive = getattr(h, "alive", None)
                if th.is_alive() and h.name not in dead and alive is not None and not alive():
                    dead.add(h.name)
                    failed.add(h.name)
                    results.setdefault(h.name, SyncError(f"holder {h.name}: engine process died"))
                    holder_fail[h.name](results[h.name])
        for th in threads:
            th.join(max(0.0, min(5.0, deadline - time.monotonic())))
        if jt.is_alive():
            raise SyncError(f"peer reload of {joiner.name}: the joining engine did not answer within "
                            f"{self.timeout_s + 30:.0f} s")
        got = results.get("joiner")
        ok = not isinstance(got, BaseException)
        entry = {"attempt": attempt, "source": "peer", "holders": [h.name for h, _ in chosen], "ok": ok,
                 "seconds": time.perf_counter() - t0, "transfers": len(plan.transfers)}
        if not ok:
            entry["error"] = f"{type(got).__name__}: {got}"
        for (h, _), th in zip(chosen, threads):
            if th.is_alive() and h.name not in results:
                results[h.name] = SyncError(f"holder {h.name} did not answer")
            r = results.get(h.name)
            if isinstance(r, BaseException):
                entry.setdefault("holder_errors", {})[h.name] = f"{type(r).__name__}: {r}"
                alive = getattr(h, "alive", None)
                # a live holder that failed only because the joining engine gave up on this attempt
                # (another holder died) stays a candidate; a dead one, or one that cannot tell, does not
                if h.name in dead or alive is None or not alive():
                    failed.add(h.name)
                    report.refused[h.name] = f"failed during attempt {attempt}: {type(r).__name__}: {r}"
        if ok:
            entry["workers"] = got
            report.registration = {
                "joiner": [w.get("registration", {}) for w in got],
                "holders": {h.name: [w.get("registration", {}) for w in results[h.name]] for h, _ in chosen
                            if not isinstance(results.get(h.name), BaseException)},
            }
        report.attempts.append(entry)
        return ok, failed
