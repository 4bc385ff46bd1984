"""KV transfer on loopback: GB/s of a decode worker pulling a prefill's blocks, and the time
that saves against recomputing the same prompt.

The real transfer path, in one process: a `TransferServer` (its own thread, as in a prefill
worker's loop) holds blocks of a KV cache laid out as the bundled model's (bf16); a
`TransferClient` pulls them over tcp://127.0.0.1, `check_payload` validates size and CRC32,
`import_blocks` writes them into a second cache. Recompute = the same prompt prefilled by the
real engine (1 thread). Medians of --repeats.

    python benchmarks/cluster_transfer.py --out benchmarks/results/cluster_transfer.json
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from cluster_common import save

from kiln.cluster.messages import KVLayout
from kiln.cluster.transfer import TransferClient, TransferServer, check_payload
from kiln.config import EngineConfig, ModelConfig, ParallelConfig
from kiln.engine.core import EngineCore, EngineRequest
from kiln.runner import kv_io
from kiln.sampling_params import SamplingParams


@dataclass
class Block:
    block_id: int


def serve(server: TransferServer, stop: threading.Event) -> None:
    while not stop.is_set():
        if server.socket.poll(50):
            while server.serve_one():
                pass


def time_pulls(layout: KVLayout, src, dst, num_blocks: int, repeats: int) -> dict:
    ctx = zmq.Context()
    bs = layout.block_size
    blocks = [Block(i) for i in range(num_blocks)]

    def export(held: list[Block]) -> memoryview:
        return kv_io.as_bytes(kv_io.export_blocks(src, [b.block_id for b in held], bs))

    server = TransferServer(ctx, "127.0.0.1", "p", layout, export, lambda held: None)
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(server, stop), daemon=True)
    thread.start()
    client = TransferClient(ctx)
    totals, nbytes = [], 0
    for r in range(repeats + 1):
        hashes = [f"{r}-{i}".encode().ljust(16, b"\0") for i in range(num_blocks)]
        handle = server.hold(blocks, hashes)
        started = time.perf_counter()
        sock = client.socket_for(handle.address)[0]
        client.pull("req", handle, 0)
        sock.poll(30000)
        pull, header, payload, error = client.take_reply(sock)
        data = check_payload(header, payload, layout, hashes)
        kv_io.import_blocks(dst, list(range(num_blocks)), bs, data)
        if r:  # the first is a warm-up (connection setup)
            totals.append(time.perf_counter() - started)
        nbytes = len(payload)
        client.release(handle)
    stop.set()
    thread.join()
    client.close()
    server.close()
    ctx.term()
    seconds = statistics.median(totals)
    return {"blocks": num_blocks, "tokens": num_blocks * bs, "bytes": nbytes,
            "transfer_ms": seconds * 1000, "gb_per_s": nbytes / seconds / 1e9}


def time_recompute(engine: EngineCore, num_tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        prompt = torch.randint(0, engine.vocab_size, (num_tokens,),
                               generator=torch.Generator().manual_seed(r)).tolist()
        engine.add_request(EngineRequest(request_id=f"re-{num_tokens}-{r}",
                                         prompt_token_ids=prompt, cache_salt=f"{r}",
                                         params=SamplingParams(max_tokens=1, temperature=0)))
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    engine = EngineCore(EngineConfig(model=ModelConfig(), parallel=ParallelConfig(num_threads=1)))
    spec = engine.runner.kv_spec
    layout = KVLayout(kv_io.DTYPE_NAMES[spec.dtype], spec.num_layers, spec.block_size,
                      spec.num_kv_heads, spec.head_dim)
    most = max(args.tokens) // spec.block_size
    shape = (most * spec.block_size, spec.num_kv_heads, spec.head_dim)
    src = [(torch.randn(shape).to(spec.dtype), torch.randn(shape).to(spec.dtype))
           for _ in range(spec.num_layers)]
    dst = [(torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype))
           for _ in range(spec.num_layers)]
    rows = []
    for n in args.tokens:
        row = time_pulls(layout, src, dst, n // spec.block_size, args.repeats)
        row["recompute_ms"] = time_recompute(engine, n, min(args.repeats, 3))
        row["speedup"] = row["recompute_ms"] / row["transfer_ms"]
        rows.append(row)
        print(f"{n:>5} tokens: {row['bytes'] / 1e6:7.1f} MB in {row['transfer_ms']:7.1f} ms "
              f"({row['gb_per_s']:.2f} GB/s); recompute {row['recompute_ms']:7.1f} ms "
              f"({row['speedup']:.0f}x slower)", flush=True)
    save(args.out, {"layout": vars_of(layout), "rows": rows})


def vars_of(layout: KVLayout) -> dict:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


if __name__ == "__main__":
    main()
