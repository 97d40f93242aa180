"""Every control-store key trainer ranks and engine ranks meet under, in one place, in the order
they are used. Modules build keys with these functions; none formats a key of its own.

All keys sit under the control plane's prefix (a session's, e.g. ``fsverl/{session}`` or a
WeightSync's ``name``). Values: small JSON, ``ok``, or ``err:{Type}:{message}``
(``fastsync.errors.error_text``). The values' codecs live beside their users
(``fastsync.sync.handshake``: ``begun_value`` / ``parse_begun``).

**Set-up** (once per plan; :class:`fastsync.WeightSync.setup`, the engine handles' ``describe`` /
``connect``)

1. every engine rank: :func:`receiver_info_key` (plan hash, layout hash, landing tensors);
2. trainer rank 0: :func:`setup_plan_key` (the plan), then each transport's own set-up keys
   (NIXL: :func:`nixl_meta_key`, :func:`nixl_addrs_key` by each engine rank,
   :func:`nixl_send_key` by each trainer rank; relays :func:`relay_key`, :func:`armed_key`;
   delta :func:`inbox_key`, :func:`relay_inbox_key`, :func:`delta_relay_key`; torch
   :func:`torch_send_key`; rank0 :func:`rank0_shards_key`);
3. trainer rank 0: :func:`setup_connected_key` (``ok`` once every engine connected).

**Every version** ``v`` (:meth:`fastsync.WeightSync.sync`, the receivers' ``begin`` / ``finish``)

1. trainer rank 0, with ``delta=True``: :func:`delta_choice_key` (``dense`` / ``delta``);
2. every engine rank: :func:`delta_mode_key` (delta syncs), then :func:`begun_key` (armed; the
   digests it asks for; its endpoint) or a refusal;
3. every trainer rank writes (transport notifications), then :func:`sender_crc_key` (digests,
   when asked) and :func:`sender_done_key` (``ok`` / ``err:...``);
4. every engine rank verifies, flips or rolls back: :func:`flipped_key`.

Throughout: :func:`alive_key` heartbeats (``fastsync.sync.liveness``).

**Doors that drive an engine from another process**

* signed engine requests (``fastsync.engines.vllm.remote``): :func:`engine_seq_key`,
  :func:`engine_cmd_key`, :func:`engine_reply_key`;
* vLLM's weight-transfer backend (``fastsync.engines.vllm.weight_transfer*``):
  :func:`wt_describe_key`, :func:`wt_connect_key`, :func:`wt_connected_key`,
  :func:`wt_version_key`, :func:`wt_open_key`, :func:`wt_staged_key`, :func:`wt_finished_key`,
  :func:`wt_session_key`, :func:`wt_base_version_key`;
* the host kit's path choice (``fastsync.host.path_choice``): :func:`rollout_mode_key`;
* barriers (``ControlPlane.barrier``, the benches'): :func:`barrier_key`, :func:`barrier_member_key`,
  :func:`barrier_go_key`.
"""

from __future__ import annotations

__all__ = [
    "setup_plan_key", "setup_connected_key", "receiver_info_key", "begun_key", "flipped_key", "sender_crc_key",
    "sender_done_key", "delta_choice_key", "delta_mode_key", "alive_key",
    "nixl_meta_key", "nixl_addrs_key", "nixl_send_key", "armed_key", "batches_key", "relay_key", "inbox_key",
    "relay_inbox_key", "delta_relay_key", "torch_send_key", "rank0_shards_key",
    "engine_seq_key", "engine_cmd_key", "engine_reply_key",
    "wt_describe_key", "wt_connect_key", "wt_connected_key", "wt_version_key", "wt_open_key", "wt_staged_key",
    "wt_session_key", "wt_base_version_key", "wt_finished_key", "rollout_mode_key", "barrier_key",
    "barrier_member_key", "barrier_go_key",
]


# ---- set-up -----------------------------------------------------------------------------------
def setup_plan_key(name: str, setup: int) -> str:
    """Trainer rank 0's plan for WeightSync ``name``'s ``setup``-th set-up."""
    return f"{name}/setup{setup}/plan"


def setup_connected_key(name: str, setup: int) -> str:
    """``ok`` once every engine connected for that set-up, or ``err:...``."""
    return f"{name}/setup{setup}/connected"


def receiver_info_key(engine_rank: int) -> str:
    """An engine rank's plan hash, engine-layout hash and landing tensors."""
    return f"recv/{engine_rank}/info"


# ---- every version ----------------------------------------------------------------------------
def delta_choice_key(version: int) -> str:
    """``dense`` or ``delta``: what ``WeightSync(delta=True)`` on trainer rank 0 chose for
    ``version``, set before the engines begin it (every engine rank asks for the same kind)."""
    return f"send/delta/{version}"


def delta_mode_key(engine_rank: int, version: int) -> str:
    """``dense``, or ``delta:{held version}`` (set by the engine rank before ``begun``)."""
    return f"recv/{engine_rank}/delta/{version}"


def begun_key(engine_rank: int, version: int) -> str:
    """The engine rank is armed for ``version`` (``fastsync.sync.handshake.begun_value``) or refused it."""
    return f"recv/{engine_rank}/begun/{version}"


def sender_crc_key(trainer_rank: int, version: int) -> str:
    """A trainer rank's digests of what it sent in ``version`` (JSON ``{transfer index: digest}``)."""
    return f"send/{trainer_rank}/crc/{version}"


def sender_done_key(trainer_rank: int, version: int) -> str:
    """A trainer rank's ``ok`` / ``err:...`` for ``version``."""
    return f"send/{trainer_rank}/done/{version}"


def flipped_key(engine_rank: int, version: int) -> str:
    """The engine rank serves ``version`` (``ok``) or rolled it back (``err:...``)."""
    return f"recv/{engine_rank}/flipped/{version}"


def alive_key(role: str, rank: int) -> str:
    """``role`` (``"trainer"`` or ``"engine"``) rank ``rank``'s heartbeat."""
    return f"alive/{role}/{rank}"


# ---- transports' set-up -----------------------------------------------------------------------
def nixl_meta_key(engine_rank: int) -> str:
    """An engine rank's NIXL agent metadata."""
    return f"nixl/recv/{engine_rank}/meta"


def nixl_addrs_key(engine_rank: int) -> str:
    """An engine rank's registered landing addresses (JSON)."""
    return f"nixl/recv/{engine_rank}/addrs"


def nixl_send_key(trainer_rank: int, engine_rank: int) -> str:
    """What a trainer rank writes to an engine rank (JSON, for the engine's check of its plan)."""
    return f"nixl/send/{trainer_rank}/to/{engine_rank}"


def armed_key(rank: int, version: int) -> str:
    """A relay hop is armed for ``version``."""
    return f"nixl/recv/{rank}/armed/{version}"


def batches_key(trainer_rank: int, engine_rank: int) -> str:
    """A trainer rank's write batches to an engine rank that relays them (JSON)."""
    return f"nixl/send/{trainer_rank}/batches/{engine_rank}"


def relay_key(engine_rank: int, child: int) -> str:
    """The agent ``engine_rank`` forwards to ``child`` from."""
    return f"nixl/relay/{engine_rank}/to/{child}"


def inbox_key(engine_rank: int) -> str:
    """An engine rank's delta inboxes (JSON)."""
    return f"nixl/delta/recv/{engine_rank}/inbox"


def relay_inbox_key(engine_rank: int) -> str:
    """``{origin trainer rank: [address, bytes, memory kind, device]}`` of a rank's relay inboxes."""
    return f"nixl/delta/recv/{engine_rank}/relay_inbox"


def delta_relay_key(engine_rank: int, child: int) -> str:
    """The agent ``engine_rank`` forwards delta pages to ``child`` from (checked by the child)."""
    return f"nixl/delta/relay/{engine_rank}/to/{child}"


def torch_send_key(trainer_rank: int, engine_rank: int) -> str:
    """The torch transport: what a trainer rank sends an engine rank (JSON)."""
    return f"torch/send/{trainer_rank}/to/{engine_rank}"


def rank0_shards_key(trainer_rank: int) -> str:
    """The rank0 transport: a trainer rank's shards and dtypes (JSON)."""
    return f"rank0/shards/{trainer_rank}"


# ---- doors ------------------------------------------------------------------------------------
def engine_seq_key(engine_id: str) -> str:
    """The counter that numbers requests to engine ``engine_id``."""
    return f"engine/{engine_id}/seq"


def engine_cmd_key(engine_id: str, n: int) -> str:
    """Request ``n`` to engine ``engine_id`` (signed JSON)."""
    return f"engine/{engine_id}/cmd/{n}"


def engine_reply_key(engine_id: str, n: int) -> str:
    """The answer to request ``n``."""
    return f"engine/{engine_id}/reply/{n}"


def wt_describe_key(engine_rank: int) -> str:
    """An engine rank's description (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/describe"


def wt_connect_key() -> str:
    """Trainer rank 0's plan and connect options (JSON), or ``err:{Type}:{message}``."""
    return "wt/connect"


def wt_connected_key(engine_rank: int) -> str:
    """An engine rank's connect result (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/connected"


def wt_version_key(engine_rank: int, version: int) -> str:
    """An engine rank's result of ``update_weights`` for ``version`` (JSON), or ``err:...``."""
    return f"wt/engine/{engine_rank}/v{version}"


def wt_open_key() -> str:
    """Staged receive: the version (and its deadline) trainer rank 0 opens with the next
    ``start_weight_update`` (JSON ``{"version": V, "timeout_s": T}``); vLLM's call carries none."""
    return "wt/open"


def wt_staged_key(engine_rank: int, version: int) -> str:
    """Staged receive: an engine rank's writes of ``version`` all landed (JSON with
    ``received_s``), or ``err:...`` when the receive failed; published while the engine generates."""
    return f"wt/engine/{engine_rank}/staged/{version}"


def wt_session_key() -> str:
    """Trainer rank 0's session id of the weight-transfer backend (the other trainer ranks' prefix)."""
    return "wt/session"


def wt_base_version_key() -> str:
    """The version the weight-transfer backend's trainer ranks count on from (what the engine last attempted)."""
    return "wt/base_version"


def wt_finished_key(version: int) -> str:
    """Trainer rank 0: ``version``'s update finished on every engine rank."""
    return f"wt/finished/{version}"


def rollout_mode_key(rank: int) -> str:
    """A rollout rank's answer to the host kit's path choice (JSON)."""
    return f"rollout/{rank}/mode"


def barrier_key(name: str) -> str:
    """The arrivals counter of barrier ``name``."""
    return f"barrier/{name}"


def barrier_member_key(name: str, rank: int) -> str:
    """A process's arrival at barrier ``name`` (the benches' barriers, which watch every process)."""
    return f"barrier/{name}/{rank}"


def barrier_go_key(name: str) -> str:
    """Set once every rank arrived at barrier ``name``."""
    return f"barrier/{name}/go"
