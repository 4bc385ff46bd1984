"""Grammar compilation for one tokenizer: background threads, a bounded cache, a time limit.

`GrammarCompiler.submit(spec)` returns a `Compilation` at once; the grammar compiles on a
small thread pool (xgrammar releases the GIL), so the engine keeps stepping (the request's
prompt prefills meanwhile) and polls it. `compile(spec)` waits for one, at most the time limit.

The cache is an LRU of compiled grammars bounded by xgrammar's own size estimate
(`cache_bytes`), so any number of distinct schemas keeps memory bounded (the grammar-cache DoS
of CVE-2025-29770 / GHSA-hf3c-wxg2-49q9). Concurrent requests for one spec share one compile.

Time limit (`compile_timeout_s`): the gateway builds grammars only (lazy masks: xgrammar's
dynamic compilation), and one still building at the limit is refused with
`grammar_too_expensive`; the spec is remembered as refused (a bounded LRU), so resubmitting it
fails at once instead of starting another compile. Engines precompute token masks (decoding
never waits on one); a precompute still running at the limit (50 distinct tools take seconds)
is replaced by the lazy-mask grammar, which computes each mask when a state is first reached.
A native compile cannot be interrupted: it finishes in the background (an engine then caches
the precomputed grammar; a refused spec's result is dropped). Size limits keep that rare.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kiln.config import StructuredConfig
from kiln.structured.grammar_spec import (
    MAX_WHITESPACE,
    GrammarError,
    GrammarSpec,
    check_spec,
    patch_schema,
)

log = logging.getLogger(__name__)
COMPACT_SEPARATORS = (",", ":")  # JSON without free whitespace: item and key separators
MAX_REFUSED = 4096  # specs remembered as invalid or too expensive
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass
class CompilerStats:
    """Totals since the compiler was made (for metrics and benchmarks)."""

    hits: int = 0  # specs served from the cache (or from a compile already running)
    misses: int = 0  # compiles started
    compile_seconds: float = 0.0  # wall time of finished compiles
    last_compile_s: float = 0.0  # the most recent one
    refused: int = 0  # invalid, too large or too expensive
    lazy_fallbacks: int = 0  # eager compiles past the time limit, replaced by lazy masks


class Compilation:
    """One spec's compile: poll it from the step loop, or wait on it. With a `fallback`, a
    compile still running at the deadline is replaced once by the fallback's (lazy masks)."""

    def __init__(self, future: Future, timeout_s: float, on_timeout: Callable[[], None],
                 fallback: Callable[[], Future] | None = None):
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._fallback = fallback

    def poll(self):
        """The CompiledGrammar, or None while it compiles; GrammarError if it failed or ran
        out of time."""
        if self.future.done():
            return self.future.result()  # raises the compile's GrammarError
        if time.monotonic() < self.deadline:
            return None
        self._fall_back()
        return self.poll()

    def wait(self):
        """Block until compiled (at most until the deadline); GrammarError otherwise."""
        while True:
            try:
                return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                self._fall_back()

    async def wait_async(self):
        """`wait` for an event loop: the loop keeps running; the compile is never cancelled
        (other requests may share it)."""
        while True:
            remaining = max(0.0, self.deadline - time.monotonic())
            try:
                return await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(self.future)), remaining)
            except TimeoutError:
                self._fall_back()

    def _fall_back(self) -> None:
        """Past the deadline: switch to the fallback compile, or fail."""
        if self._fallback is None:
            self._on_timeout()
            raise GrammarError(f"compiling the grammar took longer than {self.timeout_s:g} s",
                               code="grammar_too_expensive")
        self.future, self._fallback = self._fallback(), None
        self.deadline = time.monotonic() + self.timeout_s


class GrammarCompiler:
    def __init__(self, tokenizer_info: Callable[[], object], config: StructuredConfig,
                 lazy_masks: bool = False):
        """`tokenizer_info()` returns the xgrammar TokenizerInfo; it is called once, on a
        compile thread, when the first grammar compiles.

        lazy_masks=False (engines): token masks are precomputed while compiling, so decoding
        never waits for one; a compile still running at the time limit falls back to lazy
        masks (the grammar is usable at once; each mask is computed the first time a state
        is reached, then cached). lazy_masks=True (the gateway, which only checks grammars):
        only the grammar is built, and the time limit applies to that."""
        self.config = config
        self.lazy_masks = lazy_masks
        self._tokenizer_info = tokenizer_info
        self._xgr: dict[bool, object] = {}  # lazy_masks -> xgrammar.GrammarCompiler
        self._pool = ThreadPoolExecutor(config.compile_threads, thread_name_prefix="kiln-grammar")
        self._lazy_pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar-lazy")
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()  # building the xgrammar compilers (slow, once)
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[tuple[GrammarSpec, bool], Future] = {}
        self._refused: OrderedDict[GrammarSpec, GrammarError] = OrderedDict()
        self.stats = CompilerStats()

    # -- public -------------------------------------------------------------------------------

    def submit(self, spec: GrammarSpec) -> Compilation:
        """Start (or join, or finish from the cache) the compile of `spec`; never blocks."""
        with self._lock:
            future = self._lookup(spec)
            if future is None:
                self.stats.misses += 1
                future = self._start(spec, self.lazy_masks)
            else:
                self.stats.hits += 1
        fallback = None if self.lazy_masks else lambda: self._fallback(spec)
        return Compilation(future, self.config.compile_timeout_s, lambda: self._refuse_slow(spec),
                           fallback)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar, waiting at most the time limit (GrammarError otherwise)."""
        return self.submit(spec).wait()

    def inflight(self) -> list[Future]:
        """Compiles running now."""
        with self._lock:
            return list(self._inflight.values())

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lazy_pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------------

    def _lookup(self, spec: GrammarSpec) -> Future | None:
        """A future for a cached, refused or in-flight spec (caller holds the lock)."""
        if spec in self._cache:
            self._cache.move_to_end(spec)
            return _done(self._cache[spec])
        if spec in self._refused:
            self._refused.move_to_end(spec)
            return _failed(self._refused[spec])
        return self._inflight.get((spec, self.lazy_masks))

    def _start(self, spec: GrammarSpec, lazy: bool) -> Future:
        """A new compile (caller holds the lock)."""
        pool = self._lazy_pool if lazy and not self.lazy_masks else self._pool
        future = pool.submit(self._compile_and_store, spec, lazy)
        self._inflight[(spec, lazy)] = future
        return future

    def _fallback(self, spec: GrammarSpec) -> Future:
        """The lazy-mask compile of a spec whose eager compile ran out of time."""
        with self._lock:
            self.stats.lazy_fallbacks += 1
            log.info("grammar compile over %g s: using lazy masks (%s, %d bytes)",
                     self.config.compile_timeout_s, spec.kind, spec.size)
            if spec in self._cache:
                return _done(self._cache[spec])
            return self._inflight.get((spec, True)) or self._start(spec, True)

    def _compile_and_store(self, spec: GrammarSpec, lazy: bool):
        started = time.perf_counter()
        try:
            check_spec(spec, self.config.max_source_bytes)
            compiled = self._native_compile(spec, lazy)
        except GrammarError as exc:
            self._store_refusal(spec, lazy, exc)
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
            error = GrammarError(f"invalid {spec.kind}: {native_message(exc)}")
            self._store_refusal(spec, lazy, error)
            raise error from None
        seconds = time.perf_counter() - started
        with self._lock:
            self._inflight.pop((spec, lazy), None)
            self.stats.compile_seconds += seconds
            self.stats.last_compile_s = seconds
            if spec not in self._refused:  # not timed out meanwhile
                self._insert(spec, compiled)
        return compiled

    def _native_compile(self, spec: GrammarSpec, lazy: bool):
        c = self._compiler(lazy)
        # without free whitespace, compact separators: xgrammar's default (", ", ": ") forces
        # spaces models often would not write, and on the default model that pushed greedy
        # JSON into runaway numbers and repeated elements (2 of 8 everyday schemas parsed,
        # 6 of 8 compact; docs/structured.md)
        ws = {"any_whitespace": spec.any_whitespace,
              "max_whitespace_cnt": MAX_WHITESPACE if spec.any_whitespace else None,
              "separators": None if spec.any_whitespace else COMPACT_SEPARATORS}
        if spec.kind == "json":
            source = json.dumps(patch_schema(json.loads(spec.source)))
            return c.compile_json_schema(source, strict_mode=True, **ws)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind in ("choice", "grammar"):
            return c.compile_grammar(spec.source)
        return c.compile_structural_tag(spec.source)

    def _compiler(self, lazy: bool):
        with self._init_lock:
            if lazy not in self._xgr:
                import xgrammar as xgr
                self._xgr[lazy] = xgr.GrammarCompiler(
                    self._tokenizer_info(), cache_enabled=False,
                    max_threads=self.config.compile_threads, enable_dynamic_compilation=lazy)
            return self._xgr[lazy]

    def _insert(self, spec: GrammarSpec, compiled) -> None:
        """Cache `compiled` (replacing a lazy-mask one: the precomputed grammar wins)."""
        size = compiled.memory_size_bytes
        if size > self.config.cache_bytes:
            return  # larger than the whole cache: used once, not kept
        if spec in self._cache:
            self._cache_bytes -= self._cache.pop(spec).memory_size_bytes
        self._cache[spec] = compiled
        self._cache_bytes += size
        while self._cache_bytes > self.config.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.memory_size_bytes

    def _store_refusal(self, spec: GrammarSpec, lazy: bool, error: GrammarError) -> None:
        with self._lock:
            self._inflight.pop((spec, lazy), None)
            self._remember_refused(spec, error)

    def _refuse_slow(self, spec: GrammarSpec) -> None:
        with self._lock:
            if spec not in self._refused and spec not in self._cache:
                log.warning("grammar compile over %g s: refused (%s, %d bytes)",
                            self.config.compile_timeout_s, spec.kind, spec.size)
                self._remember_refused(spec, GrammarError(
                    f"compiling the grammar took longer than {self.config.compile_timeout_s:g} s",
                    code="grammar_too_expensive"))

    def _remember_refused(self, spec: GrammarSpec, error: GrammarError) -> None:
        self.stats.refused += 1
        self._refused[spec] = error
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)


def native_message(exc: Exception) -> str:
    """xgrammar's reason without its timestamp and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", text)[:500]


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(error: Exception) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
