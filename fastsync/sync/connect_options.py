"""What a trainer tells an engine's workers when it connects them, as typed records.

Three calls cross to an engine's workers with options: ``fastsync_connect`` (built by
``WeightSync`` for its engines and by vLLM's weight-transfer trainer; also by a joining engine's
own reload receive), ``fastsync_reload_send`` and ``fastsync_reload_receive`` (built by the reload
coordinator for holders and joiners). The records are built once on the trainer side, cross as a
plain dict (``wire()``: Ray, ``collective_rpc``, HTTP and the control store all carry JSON-able
dicts), and are read back on the worker side with :meth:`parse`, which names the call and the key
of anything unknown, missing or of the wrong type before any byte moves: an options dict can come
from the network (vLLM's weight-transfer API reads it from the control store), so nothing in it is
taken on trust.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.errors import ConfigError
from fastsync.executor.verify_mode import verify_mode
from fastsync.layout.limits import check_seconds
from fastsync.sync.sync_options import check_sync_options

__all__ = ["StoreAddress", "ConnectOptions", "ReloadReceiveOptions", "ReloadSendOptions"]

T = TypeVar("T", bound="StoreAddress")

_KINDS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                                       "dict": (dict,)}


def _check(what: str, key: str, kind: str, value: Any) -> Any:
    """``value`` as the field's type (an int where a float is asked becomes a float), or a
    ConfigError naming the call and the key."""
    kinds = [k.strip() for k in kind.split("|")]
    if value is None and "None" in kinds:
        return None
    for base in (k for k in kinds if k != "None"):
        if isinstance(value, _KINDS[base]) and not (base in ("int", "float") and isinstance(value, bool)):
            return float(value) if base == "float" else value
    raise ConfigError(f"{what}: option {key!r} must be {kind.replace('| None', 'or None').replace(' | ', ' or ')}, "
                      f"got {value!r}")


@dataclass(frozen=True, kw_only=True)
class StoreAddress:
    """Where the job's control store is and which part of it a call uses. ``control_secret``:
    the job secret, hex (default ``$FASTSYNC_JOB_SECRET`` in the process that reads it)."""

    control_port: int
    control_host: str = DEFAULT_HOST
    control_prefix: str = "fs"
    control_secret: str | None = None

    #: what a call's error messages are named by (``parse`` takes it too)
    call: ClassVar[str] = "connect"

    def __post_init__(self) -> None:
        if not 0 < self.control_port <= 65535:
            raise ConfigError(f"{self.call}: option 'control_port' must be a TCP port (1-65535), "
                              f"got {self.control_port!r}")
        if not self.control_prefix:
            raise ConfigError(f"{self.call}: option 'control_prefix' must not be empty")
        for f in dataclasses.fields(self):
            if f.name.endswith("timeout_s"):  # finite, positive, at most a day: every wait has a deadline
                check_seconds(f"{self.call}: option {f.name!r}", getattr(self, f.name))

    @classmethod
    def parse(cls: type[T], options: Mapping[str, Any], what: str | None = None) -> T:
        """The record from a dict that crossed to this process: ConfigError naming ``what`` (the
        call) and the key for an unknown or missing key or a value of the wrong type."""
        what = what or cls.call
        if not isinstance(options, Mapping):
            raise ConfigError(f"{what}: options must be a dict, got {type(options).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(options) - set(fields)
        if unknown:
            raise ConfigError(f"{what}: unknown option(s) {sorted(unknown)}")
        missing = [n for n, f in fields.items()
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in options]
        if missing:
            raise ConfigError(f"{what}: options need {', '.join(repr(m) for m in missing)}")
        return cls(**{k: _check(what, k, str(fields[k].type), v) for k, v in options.items()})

    def wire(self) -> dict[str, Any]:
        """The record as the dict that crosses to the workers (``parse`` reads it back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def control(self) -> TCPStoreControl:
        """A client of the store at this address, under this prefix, with this secret."""
        return TCPStoreControl.client(self.control_port, host=self.control_host, prefix=self.control_prefix,
                                      secret=self.control_secret)

    @staticmethod
    def of(control: Any, port: int | None = None, prefix: str | None = None) -> dict[str, Any]:
        """The address fields of a live ``TCPStoreControl`` (its port, host, prefix and secret,
        hex), to build a record with: ``ConnectOptions(**StoreAddress.of(control), ...)``."""
        secret = getattr(control, "secret", None)
        return {"control_port": int(port if port is not None else control.port),
                "control_host": getattr(control, "host", None) or DEFAULT_HOST,
                "control_prefix": prefix if prefix is not None else getattr(control, "prefix", "fs"),
                "control_secret": secret.hex() if secret else None}


@dataclass(frozen=True, kw_only=True)
class ConnectOptions(StoreAddress):
    """``fastsync_connect``: one engine rank's receiver for a plan. ``delta``: deltas land in the
    same memory under the same fence (``WeightSync(delta=True)``); ``staged``: writes land off the
    live model and the engine generates until the flip (not with ``delta``); ``trace``: finish
    returns this rank's phases."""

    transport: str = "nixl"
    transport_options: dict | None = None
    timeout_s: float = 60.0
    verify: bool | str = False
    trace: bool = False
    delta: bool = False
    staged: bool = False

    call: ClassVar[str] = "fastsync_connect"

    def __post_init__(self) -> None:
        super().__post_init__()
        verify_mode(self.verify, f"{self.call}: option 'verify'")
        try:  # the rules every entry point's options follow (a delta needs NIXL, not with staged)
            check_sync_options(transport=self.transport, timeout_s=self.timeout_s, delta=self.delta,
                               staged=self.staged)
        except ConfigError as e:
            raise ConfigError(f"{self.call}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class ReloadReceiveOptions(StoreAddress):
    """``fastsync_reload_receive``: a joining engine waits for ``weight_version`` from live
    holders, in the handshake version ``handshake_version`` of the attempt's own ``control_prefix``
    (one namespace per attempt, so it has no default). ``rank_offset``: this engine's first rank in
    a plan that fills several joining engines at once."""

    control_prefix: str = dataclasses.field()  # no default (the base class's "fs" is not inherited)
    handshake_version: int
    weight_version: int
    timeout_s: float = 60.0
    rank_offset: int = 0

    call: ClassVar[str] = "fastsync_reload_receive"

    def connect(self) -> ConnectOptions:
        """The receiver's own connect options for this attempt."""
        return ConnectOptions(control_port=self.control_port, control_host=self.control_host,
                              control_prefix=self.control_prefix, control_secret=self.control_secret,
                              transport="nixl", timeout_s=self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class ReloadSendOptions(ReloadReceiveOptions):
    """``fastsync_reload_send``: a holder writes its shards of ``weight_version``.
    ``chunk_bytes``: write batches (what a joining engine in a chain forwards at once);
    ``in_flight``: batches outstanding at once."""

    chunk_bytes: int | None = None
    in_flight: int | None = None

    call: ClassVar[str] = "fastsync_reload_send"
