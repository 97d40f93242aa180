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

Several engines joining at once (:meth:`PeerReload.reload_group`): with one holder per joining
engine, K engines need K holders to join in the time of one, and a checkpoint served by one
storage NIC takes K times as long as one engine's copy. Instead the joining engines (one layout)
become identical replicas of one plan: the holders write the chain roots and every joining engine
forwards each write batch that landed to the next one while it keeps receiving (the relays of a
sync into identical engines, ``plan/relay.py``), so few holders fill many engines in about one
copy's time plus one batch per hop.

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
from fastsync.layout.limits import check_bytes
from fastsync.layout.types import EngineLayout, TrainerLayout
from fastsync.layout.engine_json import engine_tensors_from_json
from fastsync.plan.types import Plan
from fastsync.reload.plans import PlanCache
from fastsync.reload.source import HolderRanks, engine_source_layout, merge_sources, params_of, target_layout
from fastsync.sync.connect_options import ReloadReceiveOptions, ReloadSendOptions, StoreAddress
from fastsync.protocol import sender_done_key

__all__ = ["PeerReload", "ReloadReport"]

_HANDSHAKE_VERSION = 1  # each attempt has its own namespace, so its handshake number can be 1


@dataclass(slots=True)
class ReloadReport:
    """What one reload did. ``source``: "peer" or "checkpoint" (a group: "peer" when every joining
    engine was filled from peers); ``holders``: the holders that filled it; ``refused``: holder ->
    why it was not used; ``attempts``: one dict per attempt; ``joiners``: the joining engines;
    ``fanout``: a group's chains (roots, replicas, relayed copies)."""

    version: int
    source: str = ""
    holders: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    attempts: list[dict] = field(default_factory=list)
    plan_cached: bool = False
    plan_s: float = 0.0
    weights_s: float = 0.0
    registration: dict = field(default_factory=dict)
    joiners: list[str] = field(default_factory=list)
    fanout: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


_Chosen = list[tuple[Any, "HolderRanks | TrainerLayout"]]


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
        report = ReloadReport(version, joiners=[joiner.name])
        t0 = time.perf_counter()
        target = target_layout([engine_tensors_from_json(w["tensors"]) for w in joiner.reload_describe()],
                               description=f"joining engine {joiner.name}")
        params = params_of(target.tensors)
        live = self._live_holders(holders, version, report)
        seq = next(self._seq)
        for attempt in itertools.count(1):
            if not live:
                break
            chosen = sorted(live, key=lambda hr: self.served.get(hr[0].name, 0))[: self.max_holders]
            plan = self._plan(chosen, params, target, report)
            done, failed = self._attempt(seq, attempt, [(joiner, 0)], chosen, plan, version, report, on_attempt)
            if done:
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
        self._from_checkpoint([joiner], checkpoint, version, report)
        report.source = "checkpoint"
        report.weights_s = time.perf_counter() - t0
        return report

    def reload_group(self, joiners: list[Any], holders: list[Any], version: int, *, fanout: str = "auto",
                     max_transfer_bytes: int = 1 << 20, in_flight: int = 8, checkpoint: str | None = None,
                     on_attempt: Callable[[int, list[Any]], None] | None = None) -> ReloadReport:
        """Fill several joining engines of one layout at once from every live holder of ``version``.

        The joining engines are identical replicas of one plan (``build_plan(fanout=...)``, as
        for a sync into identical engines): the holders write into the chain roots and each
        joining engine forwards what landed to the next one while it still receives (relays, in
        write batches of at most ``max_transfer_bytes``), so a few holders fill many engines in
        about the time one engine takes, instead of one holder per engine. ``in_flight``: write
        batches each holder keeps in flight (a root's acknowledgements queue behind what it
        forwards, so one batch at a time idles the link for a long round trip). ``fanout``: ``auto``
        (the planner's cost model picks the number of chains), ``chain`` (one chain), ``direct``
        (the holders write every copy themselves). A joining engine left unfilled by an attempt
        (its chain broke: a holder or an upstream engine failed) rolls back and is retried with
        the rest, then from the checkpoint. Raises SyncError when some stay unfilled."""
        if fanout not in ("auto", "chain", "direct"):
            raise ConfigError(f"reload_group fanout must be 'auto', 'chain' or 'direct', got {fanout!r}")
        check_bytes("reload_group max_transfer_bytes", max_transfer_bytes)
        if not 1 <= in_flight <= 64:
            raise ConfigError(f"reload_group in_flight must be in [1, 64], got {in_flight}")
        names = [j.name for j in joiners]
        if not joiners or len(set(names)) != len(names):
            raise ConfigError(f"reload_group needs distinct joining engines, got {names}")
        report = ReloadReport(version, joiners=names)
        t0 = time.perf_counter()
        one = {}
        for j in joiners:
            one[j.name] = target_layout([engine_tensors_from_json(w["tensors"]) for w in j.reload_describe()],
                                        description=f"joining engine {j.name}")
            if one[j.name].fingerprint() != one[names[0]].fingerprint():
                raise ConfigError(f"reload_group: joining engine {j.name} has another layout than {names[0]} "
                                  f"({one[j.name].fingerprint()} vs {one[names[0]].fingerprint()}); reload it on its own")
        params = params_of(one[names[0]].tensors)
        live = self._live_holders(holders, version, report)
        seq = next(self._seq)
        pending = list(joiners)
        for attempt in itertools.count(1):
            if not live or not pending:
                break
            width = one[names[0]].world_size
            target = replicas_of(one[names[0]], len(pending), f"{len(pending)} joining engines")
            plan = self._plan(live, params, target, report, fanout=fanout if len(pending) > 1 else "off",
                              max_transfer_bytes=max_transfer_bytes)
            if plan.fanout is not None:
                f = plan.fanout
                report.fanout = {"mode": fanout, "replicas": f.replicas, "roots": sum(p < 0 for p in f.parents),
                                 "depth": max(f.depth(k) for k in range(f.replicas)), "relayed": plan.has_relays}
            done, failed = self._attempt(seq, attempt, [(j, k * width) for k, j in enumerate(pending)], live, plan,
                                         version, report, on_attempt,
                                         {"chunk_bytes": max_transfer_bytes, "in_flight": in_flight})
            pending = [j for j in pending if j.name not in done]
            for h, _ in live:
                self.served[h.name] = self.served.get(h.name, 0) + 1
            if pending and not done and not failed:  # no progress with every holder answering
                break
            live = [hr for hr in live if hr[0].name not in failed]
        report.holders = sorted({h for a in report.attempts if a.get("source") == "peer" for h in a["holders"]})
        if pending:
            left = [j.name for j in pending]
            if checkpoint is None:
                raise SyncError(f"peer reload of {left} to version {version} failed and no checkpoint was given: "
                                f"refused {report.refused}; attempts {report.attempts}")
            self._from_checkpoint(pending, checkpoint, version, report)
        report.source = "checkpoint" if len(pending) == len(joiners) else "peer" if not pending else "peer+checkpoint"
        report.weights_s = time.perf_counter() - t0
        return report

    def _live_holders(self, holders: list[Any], version: int, report: ReloadReport) -> _Chosen:
        """The holders of ``version`` with plain copies, as source layouts; the rest go to
        ``report.refused`` with why."""
        live: _Chosen = []
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
        return live

    def _plan(self, chosen: _Chosen, params: dict, target: EngineLayout, report: ReloadReport, **kw: Any) -> Plan:
        hit_before = self.cache.hits
        source = merge_sources([hr if isinstance(hr, TrainerLayout) else engine_source_layout([hr], params)
                                for _, hr in chosen], params)
        plan = self.cache.get(params, source, target, **kw)
        report.plan_cached = self.cache.hits > hit_before
        report.plan_s += self.cache.last_plan_s
        return plan

    @staticmethod
    def _from_checkpoint(joiners: list[Any], checkpoint: str, version: int, report: ReloadReport) -> None:
        """Every joining engine in ``joiners`` loads ``checkpoint`` (at once); the first failure raises."""
        t1 = time.perf_counter()
        got: dict[str, Any] = {}

        def load(j: Any) -> None:
            try:
                got[j.name] = j.load_checkpoint(checkpoint, version)
            except BaseException as e:  # noqa: BLE001 - raised below, naming the engine
                got[j.name] = e

        threads = [threading.Thread(target=load, args=(j,), daemon=True) for j in joiners]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        bad = {n: r for n, r in got.items() if isinstance(r, BaseException)}
        if bad:
            n, e = next(iter(bad.items()))
            raise SyncError(f"joining engine {n}: loading the checkpoint {checkpoint} failed: {type(e).__name__}: {e}") from e
        entry: dict[str, Any] = {"source": "checkpoint", "ok": True, "seconds": time.perf_counter() - t1}
        if len(joiners) == 1:
            entry["workers"] = got[joiners[0].name]
        else:
            entry["joiners"], entry["workers_of"] = [j.name for j in joiners], got
        report.attempts.append(entry)

    def _attempt(self, seq: int, attempt: int, receivers: list[tuple[Any, int]], chosen: _Chosen, plan: Plan,
                 version: int, report: ReloadReport, on_attempt: Callable[[int, list[Any]], None] | None,
                 send_opts: dict | None = None) -> tuple[set[str], set[str]]:
        """One attempt: every joining engine in ``receivers`` (handle, its first engine rank in
        ``plan``) waits, the ``chosen`` holders send. Returns (joining engines filled, holders that
        failed and must not be asked again)."""
        plan_json = plan.dumps()
        prefix = f"reload/{seq}/{attempt}"
        ctl = self.control.with_prefix(prefix)
        # the store's address as the engines' workers reach it (another host on a cluster), and the
        # job secret: the workers' store clients and NIXL notifications need it
        base = dict(StoreAddress.of(self.control, prefix=prefix), handshake_version=_HANDSHAKE_VERSION,
                    weight_version=version, timeout_s=self.timeout_s)
        results: dict[tuple[str, str], Any] = {}
        failed: set[str] = set()

        def run(key: tuple[str, str], fn: Callable[[], Any],
                on_fail: Callable[[BaseException], None] | None = None) -> None:
            try:
                results[key] = fn()
            except BaseException as e:
                results[key] = e
                if on_fail is not None:
                    on_fail(e)

        t0 = time.perf_counter()
        jts = []
        for j, first in receivers:
            opts = ReloadReceiveOptions(**base, rank_offset=first).wire()
            jt = threading.Thread(target=run, args=(("j", j.name), lambda j=j, o=opts: j.reload_receive(plan_json, o)),
                                  daemon=True)
            jt.start()
            jts.append(jt)
        if on_attempt is not None:
            on_attempt(attempt, [h for h, _ in chosen])
        threads = []
        holder_fail: dict[str, Callable[[BaseException], None]] = {}
        offset = 0
        for h, hr in chosen:
            width = hr.world_size if isinstance(hr, TrainerLayout) else len(hr.tensors)
            ranks = list(range(offset, offset + width))

            def fail(e: BaseException, h=h, ranks=ranks) -> None:
                for r in ranks:  # the joining engines stop waiting for this holder at once
                    ctl.set(sender_done_key(r, _HANDSHAKE_VERSION), f"err:holder {h.name} failed: {type(e).__name__}: {e}")

            holder_fail[h.name] = fail
            opts = ReloadSendOptions(**base, rank_offset=offset, **(send_opts or {})).wire()
            th = threading.Thread(target=run, args=(("h", h.name), lambda h=h, opts=opts: h.reload_send(plan_json, opts),
                                                    fail), daemon=True)
            th.start()
            threads.append(th)
            offset += width
        # watchdog: a holder whose process died is failed at once (its RPC may never return), so
        # the joining engines stop waiting for it instead of running into their deadline
        deadline = time.monotonic() + self.timeout_s + 30
        dead: set[str] = set()
        while any(jt.is_alive() for jt in jts) and time.monotonic() < deadline:
            next(jt for jt in jts if jt.is_alive()).join(0.2)
            for (h, _), th in zip(chosen, threads):
                alive = getattr(h, "alive", None)
                if th.is_alive() and h.name not in dead and alive is not None and not alive():
                    dead.add(h.name)
                    failed.add(h.name)
                    results.setdefault(("h", h.name), SyncError(f"holder {h.name}: engine process died"))
                    holder_fail[h.name](results[("h", h.name)])
        for th in threads:
            th.join(max(0.0, min(5.0, deadline - time.monotonic())))
        stuck = [j.name for (j, _), jt in zip(receivers, jts) if jt.is_alive()]
        if stuck:
            raise SyncError(f"peer reload of {', '.join(stuck)}: the joining engine did not answer within "
                            f"{self.timeout_s + 30:.0f} s")
        errors = {j.name: results[("j", j.name)] for j, _ in receivers if isinstance(results[("j", j.name)], BaseException)}
        done = {j.name for j, _ in receivers} - set(errors)
        entry: dict[str, Any] = {"attempt": attempt, "source": "peer", "holders": [h.name for h, _ in chosen],
                                 "ok": not errors, "seconds": time.perf_counter() - t0,
                                 "transfers": len(plan.transfers)}
        if errors:
            e = next(iter(errors.values()))
            entry["error"] = f"{type(e).__name__}: {e}"
        if len(receivers) > 1:
            entry["joiners"] = [j.name for j, _ in receivers]
            entry["joiner_errors"] = {n: f"{type(e).__name__}: {e}" for n, e in errors.items()}
        for (h, _), th in zip(chosen, threads):
            if th.is_alive() and ("h", h.name) not in results:
                results[("h", h.name)] = SyncError(f"holder {h.name} did not answer")
            r = results.get(("h", h.name))
            if isinstance(r, BaseException):
                entry.setdefault("holder_errors", {})[h.name] = f"{type(r).__name__}: {r}"
                alive = getattr(h, "alive", None)
                # a live holder that failed only because the joining engine gave up on this attempt
                # (another holder died) stays a candidate; a dead one, or one that cannot tell, does not
                if h.name in dead or alive is None or not alive():
                    failed.add(h.name)
                    report.refused[h.name] = f"failed during attempt {attempt}: {type(r).__name__}: {r}"
        entry["sent_bytes"] = {h.name: sum(int(w.get("bytes", 0)) for w in results[("h", h.name)]) for h, _ in chosen
                               if isinstance(results.get(("h", h.name)), list)}
        if done:
            got = {j.name: results[("j", j.name)] for j, _ in receivers if j.name in done}
            if len(receivers) == 1:
                entry["workers"] = got[receivers[0][0].name]
            else:
                entry["workers_of"] = got
            report.registration = {
                "joiner": [w.get("registration", {}) for ws in got.values() for w in ws],
                "holders": {h.name: [w.get("registration", {}) for w in results[("h", h.name)]] for h, _ in chosen
                            if not isinstance(results.get(("h", h.name)), BaseException)},
            }
        report.attempts.append(entry)
        return done, failed


def replicas_of(one: EngineLayout, count: int, description: str) -> EngineLayout:
    """``count`` copies of the joining engine layout ``one``, engine ranks ``k * W + j`` (replica k)."""
    w = one.world_size
    return EngineLayout(w * count, {k * w + j: one.tensors[j] for k in range(count) for j in range(w)},
                        {k * w + j: k for k in range(count) for j in range(w)}, kind=one.kind, description=description)
