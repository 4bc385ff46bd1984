"""Serving overhead: one workload through `LLM.generate` and through `kiln serve` over HTTP.

Workload: 64 requests of 128 distinct random prompt tokens, 128 output tokens each (greedy,
EOS ignored), on the bundled default model in bf16. Offline, the engine is capped at 32
running sequences so that both paths batch the same way; over HTTP, 32 client streams run
concurrently. Prints output tokens/s of each path and HTTP / offline (target >= 0.90).

Both paths run with OpenMP's default wait policy, as `kiln serve` gives its worker (set
OMP_WAIT_POLICY to override both); measure on a quiet machine: when other jobs oversubscribe
the cores, spinning threads can cost either path several times its speed.

The HTTP client is deliberately thin (raw asyncio streams, no JSON parsing of chunks; tokens
are counted from the final usage chunk) because it shares the machine's cores with the server.

It also prints the gateway's CPU time per output token (and as a share of the worker's):
unlike the throughput ratio, that figure barely moves with load from other work.
Both stay loaded and the two paths alternate `--repeats` times (medians reported), so load
from other work on a shared machine drifts over both alike.

    python benchmarks/serve_overhead.py [--model DIR] [--requests 64] [--concurrency 32]
                                        [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

USAGE = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    concurrency: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def make_workload(vocab_size: int, args: argparse.Namespace) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    return Workload(prompts, args.output_len, args.concurrency)


# -- offline -------------------------------------------------------------------------------

class Offline:
    """The in-process engine, loaded once, capped at `concurrency` running sequences."""

    def __init__(self, model: str, workload: Workload):
        from kiln import LLM, SamplingParams

        self.workload = workload
        self.llm = LLM(model, dtype="bfloat16", max_num_seqs=workload.concurrency)
        self.params = SamplingParams(temperature=0, max_tokens=workload.output_len,
                                     ignore_eos=True)
        self.llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], self.params,
                          use_tqdm=False)  # warm-up

    def tokens_per_s(self) -> float:
        prompts = [{"prompt_token_ids": p} for p in self.workload.prompts]
        start = time.perf_counter()
        self.llm.generate(prompts, self.params, use_tqdm=False)
        return self.workload.num_output_tokens / (time.perf_counter() - start)


# -- HTTP ----------------------------------------------------------------------------------

async def one_stream(port: int, body: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                 b"application/json\r\nConnection: close\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()  # the server closes after [DONE]
    writer.close()
    found = USAGE.findall(data)
    if b"data: [DONE]" not in data or not found:
        raise RuntimeError(f"bad response: {data[:300]!r}")
    return int(found[-1])


async def http_run(port: int, workload: Workload) -> tuple[int, float]:
    gate = asyncio.Semaphore(workload.concurrency)

    async def run(prompt: list[int]) -> int:
        body = json.dumps({"prompt": prompt, "max_tokens": workload.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        async with gate:
            return await one_stream(port, body)

    start = time.perf_counter()
    counts = await asyncio.gather(*(run(p) for p in workload.prompts))
    return sum(counts), time.perf_counter() - start


class Server:
    """`kiln serve` on a free port, warmed up; idle between measurements (its worker sleeps)."""

    def __init__(self, model: str, workload: Workload):
        self.workload, self.port = workload, _free_port()
        self.cpu: list[list[float]] = []  # per measurement: gateway, worker CPU seconds
        cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", model, "--port",
               str(self.port), "--dtype", "bfloat16", "--max-num-seqs", str(workload.concurrency)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_healthy(self.port, self.process)
        asyncio.run(http_run(self.port, Workload(workload.prompts[:4], workload.output_len, 4)))

    def tokens_per_s(self) -> float:
        before = self.cpu_seconds()
        tokens, elapsed = asyncio.run(http_run(self.port, self.workload))
        if tokens != self.workload.num_output_tokens:
            raise RuntimeError(f"got {tokens} tokens, expected {self.workload.num_output_tokens}")
        self.cpu.append([b - a for a, b in zip(before, self.cpu_seconds(), strict=True)])
        return tokens / elapsed

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time (user + system) of the gateway and of its worker so far (Linux /proc)."""
        gateway = self.process.pid
        worker = int(Path(f"/proc/{gateway}/task/{gateway}/children").read_text().split()[0])
        return _cpu(gateway), _cpu(worker)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("kiln serve exited during startup")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("kiln serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model dir (default: bundled model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating offline/HTTP measurements; medians are reported")
    args = parser.parse_args()
    from kiln.engine.core import resolve_model_path
    from kiln.serve.frontend import Frontend

    model = resolve_model_path(args.model)
    workload = make_workload(Frontend.load(model).vocab_size, args)
    offline, server = Offline(model, workload), Server(model, workload)
    runs: dict[str, list[float]] = {"offline": [], "http": []}
    try:
        for _ in range(args.repeats):  # alternate, so load drift hits both paths alike
            runs["offline"].append(offline.tokens_per_s())
            runs["http"].append(server.tokens_per_s())
    finally:
        server.stop()
    off, http = statistics.median(runs["offline"]), statistics.median(runs["http"])
    print(f"offline LLM.generate : {off:8.1f} output tokens/s  runs {_fmt(runs['offline'])}")
    print(f"HTTP, {args.concurrency} streams    : {http:8.1f} output tokens/s  runs "
          f"{_fmt(runs['http'])}")
    print(f"HTTP / offline       : {http / off:8.3f}  (median of each; target >= 0.90)")
    gateway = sum(c[0] for c in server.cpu)
    worker = sum(c[1] for c in server.cpu)
    per_token = 1e6 * gateway / (workload.num_output_tokens * len(server.cpu))
    print(f"gateway CPU          : {per_token:8.0f} us per output token "
          f"({100 * gateway / worker:.1f}% of the worker's CPU time)")


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    main()
