"""All-reduce between the ranks of one machine through shared memory.

Tensor parallelism sums partial activations twice per layer; over gloo each call crosses the
loopback TCP stack, which at decode sizes (one token's hidden state, a few KB) costs far more
than the bytes. Ranks on one machine instead exchange through one shared segment: each rank
copies its tensor into its slot, publishes a step counter, waits for every other rank's and
sums the slots. The exchange is `torch.ops.kiln.shm_all_reduce` (kiln/kernels/cpu/
allreduce.cpp); this module owns the segment's file and lifecycle. docs/shm_allreduce.md
describes the protocol, its memory ordering and its timeouts.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kiln.kernels import cpu as cpu_kernels

SEGMENT_DIR = Path("/dev/shm")
DEFAULT_TIMEOUT_S = 60.0
CACHE_LINE = 64
DTYPES = (torch.float32, torch.bfloat16)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
T = TypeVar("T")


class ShmAllReduce:
    """In-place sum of a tensor over the `world_size` ranks of one machine.

    Construction is collective: every rank constructs one with the same `name`, `world_size`
    and `max_bytes`; rank 0 creates the segment /dev/shm/kiln-allreduce-<name>, the others
    attach to it, and the constructor returns once every rank has attached (raising after
    `timeout_s` otherwise). The segment's file is removed as soon as all have attached, so
    nothing outlives the group. `name` must be unique among groups alive on the machine.

    `all_reduce_` is collective too: every rank calls it in the same order with a contiguous
    CPU tensor of the same element count and dtype; one call at a time per rank. A tensor of
    more than `max_bytes` goes through in chunks of `max_bytes` (rounded up to 64). A call
    that fails (a rank that does not arrive within `timeout_s`, ranks passing different
    tensors) leaves the group broken: every later call raises at once. `close()` unmaps the
    segment.
    """

    def __init__(self, name: str, rank: int, world_size: int, max_bytes: int, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        _check_arguments(name, rank, world_size, max_bytes, timeout_s)
        if not cpu_kernels.load():
            raise RuntimeError("the shared-memory all-reduce needs kiln's C++ CPU kernels, "
                               "which are unavailable (build failed or "
                               "KILN_DISABLE_CPU_KERNELS is set); use the gloo all-reduce")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.timeout_s = timeout_s
        self.chunk_bytes = -(-max_bytes // CACHE_LINE) * CACHE_LINE
        self._failure: str | None = None
        path = segment_path(name)
        size = torch.ops.kiln.shm_segment_bytes(world_size, self.chunk_bytes)
        if rank == 0:
            self._segment = _create_segment(path, size, world_size, self.chunk_bytes)
        else:
            self._segment = _attach_segment(path, size, rank, timeout_s)
        try:
            torch.ops.kiln.shm_segment_join(self._segment, rank, world_size, self.chunk_bytes,
                                            timeout_s)
        finally:
            if rank == 0:  # every rank has mapped it, or the group failed: the file can go
                path.unlink(missing_ok=True)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """tensor = the sum of every rank's tensor, in place: fp32, or bf16 summed in fp32 and
        rounded once. Every rank gets bit-identical results."""
        self._check_usable()
        _check_tensor(tensor)
        try:
            torch.ops.kiln.shm_all_reduce(tensor, self._segment, self.rank, self.timeout_s)
        except RuntimeError as exc:
            self._failure = str(exc).splitlines()[0]
            raise

    def all_to_all(self, send: torch.Tensor, send_bytes: list[int], recv: torch.Tensor,
                   recv_bytes: list[int]) -> None:
        """send_bytes[j] bytes of `send` (rank order) to rank j; recv_bytes[j] from rank j
        into `recv` (rank order). Contiguous CPU tensors of any dtype. Collective with
        `all_reduce_`: the same segment and step counter, in windows of the chunk (less a
        header line of offsets) while any rank has more to send (docs/shm_allreduce.md,
        "All-to-all")."""
        self._check_usable()
        try:
            torch.ops.kiln.shm_all_to_all(send, send_bytes, recv, recv_bytes, self._segment,
                                          self.rank, self.timeout_s)
        except RuntimeError as exc:
            self._failure = str(exc).splitlines()[0]
            raise

    def inside(self, kernel: Callable[[torch.Tensor, int, float], T]) -> T:
        """`kernel(segment, rank, timeout_s)`: a C++ kernel that calls kiln::shm_all_reduce
        itself (the fused decoder stack reduces after each row-parallel projection), with
        this group's checks. Collective as `all_reduce_` is: every rank's calls, from kernels
        and from `all_reduce_` alike, share the segment's step counters, so they must match
        in order, element count and dtype. A failure breaks the group, as a failed
        `all_reduce_` does (a kernel that raised midway left the ranks out of step)."""
        self._check_usable()
        try:
            return kernel(self._segment, self.rank, self.timeout_s)
        except RuntimeError as exc:
            self._failure = str(exc).splitlines()[0]
            raise

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"shm all-reduce {self.name!r} is broken by an earlier failed "
                               f"call: {self._failure}")
        if self._segment is None:
            raise RuntimeError(f"shm all-reduce {self.name!r} is closed")

    def close(self) -> None:
        """Unmap the segment (the mapping goes with its tensor); safe to call twice."""
        self._segment = None


def segment_path(name: str) -> Path:
    return SEGMENT_DIR / f"kiln-allreduce-{name}"


def _check_arguments(name: str, rank: int, world_size: int, max_bytes: int,
                     timeout_s: float) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"shm all-reduce name {name!r} must be 1-128 characters of "
                         "letters, digits, '_', '.' or '-'")
    if not 1 <= world_size <= 64:
        raise ValueError(f"shm all-reduce world_size={world_size} is outside [1, 64]")
    if not 0 <= rank < world_size:
        raise ValueError(f"shm all-reduce rank={rank} is outside [0, {world_size})")
    if max_bytes <= 0:
        raise ValueError(f"shm all-reduce max_bytes={max_bytes} must be positive")
    if not timeout_s > 0:
        raise ValueError(f"shm all-reduce timeout_s={timeout_s} must be positive")
    if not SEGMENT_DIR.is_dir():
        raise RuntimeError(f"the shared-memory all-reduce needs {SEGMENT_DIR} (Linux)")


def _check_tensor(tensor: torch.Tensor) -> None:
    if tensor.dtype not in DTYPES:
        raise TypeError(f"shm all-reduce takes float32 or bfloat16 tensors, not {tensor.dtype}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"shm all-reduce takes contiguous CPU tensors, not a "
                         f"{'contiguous' if tensor.is_contiguous() else 'strided'} tensor "
                         f"on {tensor.device}")


def _create_segment(path: Path, size: int, world_size: int, chunk_bytes: int) -> torch.Tensor:
    """Rank 0: make the segment under a private name, lay it out, then rename it into place,
    so an attaching rank never sees a half-made one (and a stale one left by a crashed group
    is replaced)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _reserve(fd, size)
        segment = _map(fd, size)
        torch.ops.kiln.shm_segment_init(segment, world_size, chunk_bytes)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return segment


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's pages now: a full /dev/shm fails here with a message rather than
    with SIGBUS at the first touch of a page it could not supply."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise RuntimeError(f"shm all-reduce: cannot reserve {size} bytes in {SEGMENT_DIR} "
                           f"({exc.strerror}); lower max_bytes or enlarge {SEGMENT_DIR}") from None


def _attach_segment(path: Path, size: int, rank: int, timeout_s: float) -> torch.Tensor:
    """Ranks > 0: wait (at most timeout_s) for rank 0's segment, then map it."""
    fd = _open_when_there(path, rank, timeout_s)
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise RuntimeError(f"shm all-reduce: {path} has {found} bytes but rank {rank} "
                               f"expects {size}: do all ranks pass the same world_size and "
                               "max_bytes?")
        return _map(fd, size)
    finally:
        os.close(fd)


def _open_when_there(path: Path, rank: int, timeout_s: float) -> int:
    """Open rank 0's segment, polling until it appears; rank 0 removes the name only once
    every rank has joined, so once open it stays the group's."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"shm all-reduce: rank {rank} gave up waiting for rank 0 "
                                   f"to create {path} (waited {timeout_s} s)") from None
            time.sleep(0.002)


def _map(fd: int, size: int) -> torch.Tensor:
    """A uint8 tensor over a shared mapping of the open file `fd` (through its /proc path, so
    it is the file already opened, never one created anew under the name); the mapping lives
    as long as the tensor."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
