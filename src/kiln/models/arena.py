"""A loaded model's weights gathered into one arena of memory on transparent huge pages (CPU).

At batch 1 a decode step reads every weight once, as ~120 small matrices (0.7-3.5 MB on the
default model) spread over as many separate allocations on 4 KiB pages: each matrix starts a
fresh run of TLB misses and a fresh prefetch stream. Gathered in module order into one
anonymous mapping, 2 MiB-aligned and advised MADV_HUGEPAGE before its first touch, the same
matrices are read through a few hundred TLB entries, one after the other. Decision 0020 has the
figures (the decoder's GEMVs on AMD EPYC Zen 4: 28.7 -> 31.4 GB/s in a probe, batch-1 decode
+10-25 %).

Storages move whole, with every tensor of the model that holds one (a MoE layer's stacked
experts and each expert's view into them), and each tensor keeps its identity (`t.data` points
into the arena), so every holder of it (a Parameter, a packed copy kept as a plain attribute, a
list built later) reads the arena. A storage that something outside the model also holds
stays, as do oneDNN's prepacked weights (opaque: the AMX CPUs' format). `KILN_WEIGHT_ARENA=0`
leaves the weights where loading put them (A/B runs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, scales) stay where they are


@dataclass(frozen=True)
class ArenaStats:
    tensors: int  # the tensors now pointing into the arena
    nbytes: int  # the arena's size


def enabled() -> bool:
    return os.environ.get("KILN_WEIGHT_ARENA", "1") != "0"


def transparent_huge_pages() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "" where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed uint8 memory starting on a 2 MiB boundary, advised MADV_HUGEPAGE
    before any page is touched; the tensor keeps its mapping alive."""
    # private: a shared anonymous mapping is shmem, which THP's usual settings leave alone
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _held(module: nn.Module):
    """The tensors a module holds: parameters, buffers, plain tensor attributes (packed
    weights) and the tensor fields of dataclass attributes (a MoE layer's stacked experts)."""
    yield from module._parameters.values()
    yield from module._buffers.values()
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                inner = getattr(value, field.name)
                if isinstance(inner, torch.Tensor):
                    yield inner


def _references(storage: torch.UntypedStorage) -> int | None:
    """How many tensors share `storage` (None where this torch cannot say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(storage._cdata) - 1  # less our own handle


def held_storages(model: nn.Module) -> list[list[torch.Tensor]]:
    """The storages worth moving, each as the tensors of `model` that hold it, in module order
    (the order a forward reads): large CPU storages every one of whose tensors a module holds
    (a stacked tensor and its experts' views move together; one with a holder outside the
    model stays, so no two copies drift apart)."""
    groups: dict[int, dict[int, torch.Tensor]] = {}
    for module in model.modules():
        for t in _held(module):
            # (oneDNN's prepacked weights are opaque: no storage to move or share)
            if (t is not None and t.device.type == "cpu" and t.layout == torch.strided
                    and not t.is_mkldnn and not t.requires_grad):
                storage = t.untyped_storage()
                if storage.nbytes() >= MIN_BYTES:
                    group = groups.setdefault(storage.data_ptr(), {})
                    group[id(t)] = t
                    if t._base is not None:  # a view keeps its base alive (and counted)
                        group[id(t._base)] = t._base
    out = []
    for group in groups.values():
        tensors = list(group.values())
        storage = tensors[0].untyped_storage()
        refs = _references(storage)
        if refs == len(tensors) or (refs is None and len(tensors) == 1
                                    and tensors[0].nbytes == storage.nbytes()):
            out.append(tensors)
    return out


def gather_weights(model: nn.Module) -> ArenaStats | None:
    """Move `model`'s large weights into one huge-page arena, in module order (None when
    disabled or nothing moves). Peak memory grows by at most the largest storage: each old
    copy is released as soon as its tensors point into the arena."""
    if not enabled():
        return None
    groups = held_storages(model)
    if not groups:
        return None
    offsets, total = [], 0
    for tensors in groups:
        offsets.append(total)
        total += -(-tensors[0].untyped_storage().nbytes() // ALIGN) * ALIGN
    arena = huge_page_buffer(total)
    with torch.no_grad():
        for tensors, offset in zip(groups, offsets, strict=True):
            storage = tensors[0].untyped_storage()
            block = arena[offset:offset + storage.nbytes()]
            block.copy_(torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage))
            del storage
            for t in tensors:
                base = block.view(t.dtype)
                t.data = base.as_strided(t.size(), t.stride(),
                                         base.storage_offset() + t.storage_offset())
    stats = ArenaStats(sum(map(len, groups)), total)
    log.info("weights: %d tensors, %.1f MB in one arena (transparent huge pages: %s)",
             stats.tensors, total / 1e6, transparent_huge_pages() or "none")
    return stats


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; False elsewhere).
    Loading frees a model's worth of unpacked and pre-arena copies that glibc otherwise keeps
    mapped: on benchmarks/moe.py's 1.2 GB model the process held 4.0-4.5 GB after loading,
    1.7 GB after this."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
