"""The gateway <-> worker wire protocol. Every message that crosses is a struct in this module.

Transport: the gateway binds one ZMQ ROUTER socket; each worker connects a DEALER socket whose
identity is `"{worker_id}.{incarnation}"` (a restarted worker gets a new incarnation, so late
messages of a dead one are told apart). One frame per message, msgpack-encoded with msgspec as a
tagged union; nothing is pickled, and a frame that does not decode to a known struct is dropped.

Gateway -> worker:  AddRequests, AbortRequests, Shutdown; for a cluster also Welcome (the
                    answer to WorkerReady: where to publish KV events), Reregister (the
                    gateway does not know this worker: send WorkerReady again), ResyncKV (send
                    a KVSnapshot), AddPrefill (compute prompt + first token, then hold the
                    prompt's blocks for transfer), AddDecode (pull a prefill's blocks, then
                    decode on) and ReleaseKV (blocks held for a transfer nobody will pull).
Worker -> gateway:  WorkerReady once, when the engine is loaded (registration: role, transfer
                    endpoint, KV layout); then StepOutputs (one per engine step that produced
                    outputs: every request's new tokens of that step, plus the stats after
                    it), Rejected (requests the engine refused), Heartbeat (at least every
                    heartbeat interval, idle or busy), PrefillDone (an AddPrefill request's
                    transfer handle), KVSnapshot, Goodbye (leaving on purpose) and
                    WorkerFailed (the engine raised; the worker exits after sending it).
Any worker message counts as a sign of life; the gateway's watchdog declares a worker stuck
when none arrives within its heartbeat timeout.

KV events (worker PUB -> gateway SUB): frames [b"kv", KVEventBatch]; batches are numbered
1, 2, 3... per worker incarnation; `WorkerStats.kv_event_seq` carries the latest number so the
gateway can find a gap even when the last batch was lost.

KV transfer (decode worker DEALER -> prefill worker ROUTER, direct, no gateway hop):
PullBlocks -> [BlocksHeader, raw payload] or PullFailed; then ReleaseBlocks. The payload is the
blocks' K and V as raw bytes ([layers, 2, blocks x block_size, kv heads, head dim] in the
header's dtype), checked against the header's size and CRC32 before use; never unpickled.
"""

from __future__ import annotations

import msgspec

from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits
from kiln.engine.prefix_cache import KVEvent


class ExpertLoadStats(msgspec.Struct, array_like=True):
    """Routed (token, expert) pairs per expert of each MoE layer since the worker started
    (kiln.models.layers.expert_parallel.ExpertLoad); sent with heartbeats only."""

    layers: list[int]  # decoder layer index of each MoE layer
    tokens: list[list[int]]  # [L][E]
    rank_tokens: list[list[int]] | None = None  # [L][T] pairs each rank computed (EP only)


class WorkerStats(msgspec.Struct, kw_only=True, array_like=True):
    """Engine state after a step; counters are cumulative since the worker started."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by requests (cached free blocks do not count)
    kv_blocks_cached: int = 0  # blocks whose content the prefix cache can still serve
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which were found
    num_steps: int = 0
    kv_event_seq: int = 0  # latest KV event batch published
    kv_blocks_held: int = 0  # blocks pinned for transfers not yet released
    kv_transfers_ok: int = 0  # pulls received, validated and imported (decode side)
    kv_transfers_failed: int = 0  # pulls that failed, timed out or were invalid: recomputed
    kv_transfer_bytes: int = 0  # payload bytes imported
    kv_transfer_seconds: float = 0.0  # pull request -> blocks imported, summed
    expert_load: ExpertLoadStats | None = None  # MoE models, in heartbeats (None: not sent)


# -- gateway -> worker ----------------------------------------------------------------------

class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort everything and exit."""

    reason: str = ""


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """The shape of one worker's KV blocks; a transfer needs equal layouts on both ends."""

    dtype: str  # torch dtype name, e.g. bfloat16
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    # what a layer's cache holds (kiln.models.layers.kv_layout.CacheHolds): "key_value", K
    # and V per KV head; "mla_latent", one row of MLA's latent and rope key (1 head)
    holds: str = "key_value"

    def shape(self, num_blocks: int) -> list[int]:
        """[layers, tensors per layer (2: K, V; 1: MLA latent), num_blocks * block_size,
        heads, head dim]"""
        per_layer = 2 if self.holds == "key_value" else 1
        return [self.num_layers, per_layer, num_blocks * self.block_size, self.num_kv_heads,
                self.head_dim]


class KVHandle(msgspec.Struct, frozen=True, array_like=True):
    """Blocks a prefill worker holds for one request until pulled, released or timed out."""

    handle_id: str  # 32 random hex digits: only the gateway and the two workers learn it
    address: str  # the prefill worker's transfer endpoint (tcp://host:port)
    worker_id: str
    block_hashes: list[bytes]  # the prompt's full blocks, in order


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    events_address: str  # connect the KV event PUB socket here


class Reregister(msgspec.Struct, tag="reregister", array_like=True):
    """The gateway does not know this worker (it restarted): abort all, send WorkerReady."""


class ResyncKV(msgspec.Struct, tag="resync", array_like=True):
    """Send a KVSnapshot of every block hash held now."""


class AddPrefill(msgspec.Struct, tag="prefill", array_like=True):
    """Run these (max_tokens 1) and, unless aborted, hold each one's full prompt blocks and
    answer PrefillDone with their handle."""

    requests: list[EngineRequest]


class DecodeItem(msgspec.Struct, array_like=True):
    request: EngineRequest  # prompt + output_token_ids so far; continues from there
    source: KVHandle | None  # pull these blocks first (None: compute the prompt here)


class AddDecode(msgspec.Struct, tag="decode", array_like=True):
    items: list[DecodeItem]


class ReleaseKV(msgspec.Struct, tag="release", array_like=True):
    handle_ids: list[str]


# -- worker -> gateway ----------------------------------------------------------------------

class WorkerReady(msgspec.Struct, tag="ready", array_like=True, kw_only=True):
    worker_id: str
    incarnation: int
    pid: int
    model_path: str
    limits: EngineLimits
    eos_token_ids: list[int]
    max_num_seqs: int
    role: str = "both"  # prefill | decode | both (a routing hint: any worker can do all)
    transfer_address: str | None = None  # where decode workers pull its held blocks
    kv_layout: KVLayout | None = None
    token: str = ""  # the cluster token, when the gateway requires one


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: WorkerStats


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    param: str | None = None
    code: str | None = None


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    rejections: list[Rejection]


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    stats: WorkerStats


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class PrefillDone(msgspec.Struct, tag="prefilled", array_like=True):
    request_id: str
    handle: KVHandle | None  # None: nothing held (no full block, or no prefix caching)


class KVSnapshot(msgspec.Struct, tag="snapshot", array_like=True):
    seq: int  # taken after event batch `seq` was published
    block_hashes: list[bytes]


class Goodbye(msgspec.Struct, tag="goodbye", array_like=True):
    """The worker is leaving on purpose (SIGTERM of `kiln worker`)."""

    reason: str


GatewayMessage = (AddRequests | AbortRequests | Shutdown | Welcome | Reregister | ResyncKV
                  | AddPrefill | AddDecode | ReleaseKV)
WorkerMessage = (WorkerReady | StepOutputs | Rejected | Heartbeat | WorkerFailed | PrefillDone
                 | KVSnapshot | Goodbye)


# -- KV events (PUB/SUB) ------------------------------------------------------------------------

class KVEventBatch(msgspec.Struct, array_like=True):
    worker_id: str
    incarnation: int
    seq: int
    events: list[KVEvent]


# -- KV transfer (decode worker -> prefill worker) --------------------------------------------

class PullBlocks(msgspec.Struct, tag="pull", array_like=True):
    handle_id: str
    start_block: int  # the puller already holds the blocks before this one
    num_blocks: int


class ReleaseBlocks(msgspec.Struct, tag="release", array_like=True):
    handle_id: str


class BlocksHeader(msgspec.Struct, tag="blocks", array_like=True):
    """Precedes one payload frame of exactly `nbytes` bytes."""

    handle_id: str
    block_hashes: list[bytes]  # of the blocks in the payload, in order
    layout: KVLayout
    shape: list[int]  # layout.shape(len(block_hashes))
    nbytes: int
    crc32: int  # zlib.crc32 of the payload


class PullFailed(msgspec.Struct, tag="pullfailed", array_like=True):
    handle_id: str
    message: str


TransferRequest = PullBlocks | ReleaseBlocks
TransferReply = BlocksHeader | PullFailed


class Codec:
    """Encoders and decoders for both directions (one instance per socket owner)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_worker = msgspec.msgpack.Decoder(GatewayMessage)
        self._to_gateway = msgspec.msgpack.Decoder(WorkerMessage)
        self._events = msgspec.msgpack.Decoder(KVEventBatch)
        self._transfer_request = msgspec.msgpack.Decoder(TransferRequest)
        self._transfer_reply = msgspec.msgpack.Decoder(TransferReply)

    def encode(self, message: GatewayMessage | WorkerMessage) -> bytes:
        return self._encoder.encode(message)

    def decode_gateway_message(self, frame: bytes) -> GatewayMessage:
        """Raise msgspec.DecodeError (or ValidationError) for anything not in the protocol."""
        return self._to_worker.decode(frame)

    def decode_worker_message(self, frame: bytes) -> WorkerMessage:
        return self._to_gateway.decode(frame)

    def encode_any(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_events(self, frame: bytes) -> KVEventBatch:
        return self._events.decode(frame)

    def decode_transfer_request(self, frame: bytes) -> TransferRequest:
        return self._transfer_request.decode(frame)

    def decode_transfer_reply(self, frame: bytes) -> TransferReply:
        return self._transfer_reply.decode(frame)


def worker_identity(worker_id: str, incarnation: int) -> bytes:
    return f"{worker_id}.{incarnation}".encode()


def parse_identity(identity: bytes) -> tuple[str, int] | None:
    """(worker_id, incarnation), or None for an identity that is not ours."""
    worker_id, _, incarnation = identity.decode(errors="replace").rpartition(".")
    return (worker_id, int(incarnation)) if worker_id and incarnation.isdigit() else None
