"""An engine over two "machines": node 0 runs the engine (rank 0), node 1 only its rank,
started as `kiln worker --nnodes 2 --node-rank 1 --dist-init-addr HOST:PORT`.

Fast (`make test`): both nodes on 127.0.0.1, node 0 in this process: PP=2 greedy tokens
identical to one process; a rank killed on node 1 fails node 0 at once naming the node and
rank; a node that never joins fails it within dist_timeout_s. Slow (`make test-all`): the two
nodes in two network namespaces joined by a veth pair (10.77.0.1 / 10.77.0.2), so every
byte between them crosses a real network interface, or, without root or `ip netns`, over
loopback with each node on its own address (127.0.0.1 / 127.0.0.2); either way each node's
gloo listens on its own address. Plus the settings' validation and torchrun's environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.distributed.communicator import RankFailure
from kiln.distributed.launch import torchrun_nodes

SETTINGS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16,
                num_threads=1)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [100, 3, 77, 4]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TIMEOUT_S = 20
REPO = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_env(**extra: str) -> dict[str, str]:
    paths = [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def follower_node(path: str, address: str, prefix: tuple[str, ...] = (),
                  **env: str) -> subprocess.Popen:
    """`kiln worker --node-rank 1` for a PP=2 engine over 2 nodes (its rank: the first
    stage)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "kiln.cli", "worker", "--model",
                             path, "--pipeline-parallel-size", "2", "--nnodes", "2",
                             "--node-rank", "1", "--dist-init-addr", address,
                             "--dist-timeout", str(TIMEOUT_S), "--threads", "1"],
                            env=node_env(**env))


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


@pytest.fixture(scope="module")
def reference(tiny_ckpt) -> list[list[int]]:
    return tokens(LLM(tiny_ckpt("llama"), **SETTINGS).generate(PROMPTS, GREEDY,
                                                               use_tqdm=False))


@pytest.fixture(scope="module")
def two_nodes(tiny_ckpt):
    """(node 0's engine, node 1's launcher) on 127.0.0.1."""
    path, address = tiny_ckpt("llama"), f"127.0.0.1:{free_port()}"
    node1 = follower_node(path, address)
    try:
        engine = LLM(path, **SETTINGS, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                     dist_init_addr=address, dist_timeout_s=TIMEOUT_S)
    except BaseException:
        node1.kill()
        raise
    yield engine, node1
    engine.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        node1.wait(10)
    if node1.poll() is None:
        node1.kill()


def test_two_nodes_match_one_process(two_nodes, reference):
    engine, node1 = two_nodes
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert node1.poll() is None  # node 1 still runs its rank


def test_a_rank_killed_on_node_1_fails_node_0_naming_it(two_nodes):
    """Runs last in the module: it ends the engine."""
    engine, node1 = two_nodes
    (rank1,) = children(node1.pid)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    threading.Timer(0.5, os.kill, (rank1, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"node 1: rank 1 exited with status -9"):
        engine.generate([list(range(1, 20))] * 8, long, use_tqdm=False)
    assert time.monotonic() - start < TIMEOUT_S
    assert node1.wait(10) == 1  # its launcher reported the rank and exited


def test_a_node_that_never_joins_fails_within_the_timeout(tiny_ckpt):
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"node 1 \(ranks 1\.\.1\) did not join within 2 s: "
                                          r"start it with --nnodes 2 --node-rank 1"):
        LLM(tiny_ckpt("llama"), **SETTINGS, pipeline_parallel_size=2, nnodes=2,
            dist_init_addr=address, dist_timeout_s=2)
    assert time.monotonic() - start < 30


def test_node_settings_are_validated():
    with pytest.raises(ValueError, match="3 ranks do not split evenly over nnodes 2"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match=r"node_rank 2 is out of range for nnodes 2 \(0..1\)"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="nnodes 2 needs dist_init_addr HOST:PORT"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    for bad in ("h", "h:", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError, match="dist_init_addr must be HOST:PORT"):
            ParallelConfig(dist_init_addr=bad)
    with pytest.raises(ValueError, match="all_reduce shm needs each tensor-parallel group on "
                                         "one node: tensor_parallel_size 2 does not divide"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, dist_init_addr="h:1",
                       all_reduce="shm")
    assert ParallelConfig(dist_init_addr="[::1]:29500").ranks_per_node == 1
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                          dist_init_addr="h:1").ranks_per_node == 2


def test_node_1_is_not_an_engine(tiny_ckpt):
    with pytest.raises(ValueError, match="node_rank 1 runs only its ranks: start it with "
                                         "`kiln worker --node-rank 1"):
        LLM(tiny_ckpt("llama"), **SETTINGS, pipeline_parallel_size=2, nnodes=2, node_rank=1,
            dist_init_addr="127.0.0.1:1")


def test_torchrun_environment():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "WORLD_SIZE": "2",
           "RANK": "1", "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_nodes(env) == {"nnodes": 2, "node_rank": 1,
                                   "dist_init_addr": "10.0.0.1:29400"}
    assert torchrun_nodes({**env, "NODE_RANK": "0"})["node_rank"] == 0
    assert torchrun_nodes({**env, "WORLD_SIZE": "1", "RANK": "0"}) == {}
    assert torchrun_nodes({}) == {}
    with pytest.raises(ValueError, match="torchrun started 2 processes per node"):
        torchrun_nodes({**env, "LOCAL_WORLD_SIZE": "2"})


# -- two network namespaces (make test-all) ------------------------------------------------

NAMESPACES = ("kiln-mn0", "kiln-mn1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
# without namespaces: one loopback interface, each node on its own address of 127.0.0.0/8
LOOPBACK_ADDRESSES = ("127.0.0.1", "127.0.0.2")
NODE0 = """
import json, sys
from kiln import LLM, SamplingParams
path, address, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16,
             num_threads=1, pipeline_parallel_size=2, nnodes=2, node_rank=0,
             dist_init_addr=address, dist_timeout_s=60)
outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                       use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
sys.stdin.readline()  # the test reads both nodes' sockets meanwhile
engine.close()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def veth_namespaces() -> Iterator[None]:
    """Two namespaces joined by a veth pair, removed (with the pair) whatever happens."""
    try:
        for ns in NAMESPACES:
            _ip("netns", "add", ns)
        _ip("link", "add", "kiln-mn0v", "type", "veth", "peer", "name", "kiln-mn1v")
        for ns, dev, addr in zip(NAMESPACES, ("kiln-mn0v", "kiln-mn1v"), ADDRESSES,
                                 strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in NAMESPACES:  # deleting a namespace deletes its end of the pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why the nodes cannot have network namespaces here (None: they can).
    KILN_TEST_LOOPBACK_NODES=1 takes the loopback fallback even where they can."""
    if os.environ.get("KILN_TEST_LOOPBACK_NODES") == "1":
        return "KILN_TEST_LOOPBACK_NODES=1"
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "not root (ip netns needs it)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"ip netns: {probe.stderr.decode().strip()}"


def loopback_unavailable() -> str | None:
    """Why a process cannot listen on 127.0.0.2 here (None: it can; Linux routes all of
    127.0.0.0/8 to the loopback interface)."""
    try:
        with socket.socket() as probe:
            probe.bind((LOOPBACK_ADDRESSES[1], 0))
    except OSError as exc:
        return f"cannot bind {LOOPBACK_ADDRESSES[1]}: {exc}"
    return None


def _ipv4(field: str) -> str:
    """/proc/net/tcp's little-endian hex "0100007F:1F90" -> "127.0.0.1"."""
    packed = bytes.fromhex(field.split(":")[0])
    return socket.inet_ntoa(packed[::-1])


def listening_addresses(pid: int) -> set[str]:
    """The IPv4 addresses process `pid`'s TCP sockets listen on (in its network namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # (an fd closed meanwhile)
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    rows = [line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]]
    return {_ipv4(row[1]) for row in rows if row[9] in inodes and row[3] == "0A"}  # LISTEN


@dataclasses.dataclass(frozen=True)
class TwoNodeRun:
    tokens: list[list[int]]
    listening: tuple[set[str], set[str]]  # node 0's engine process's, node 1's rank's


def run_two_nodes(path: str, address: str, prefixes: tuple[tuple[str, ...], ...],
                  envs: tuple[dict[str, str], ...], tmp_path: Path) -> TwoNodeRun:
    """Node 1's launcher and node 0's engine (each under its prefix and environment): the
    tokens node 0 generated and the addresses each node's gloo listens on, read while both
    run."""
    node1 = follower_node(path, address, prefixes[1], **envs[1])
    log = (tmp_path / "node0.log").open("w+")
    node0 = subprocess.Popen([*prefixes[0], sys.executable, "-c", NODE0, path, address,
                              json.dumps(PROMPTS)], env=node_env(**envs[0]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                             text=True)
    try:
        line = _read_line(node0, "TOKENS ", 400)
        assert line is not None, _tail(log, node0)
        (rank1,) = children(node1.pid)
        listening = (listening_addresses(node0.pid), listening_addresses(rank1))
        node0.stdin.write("\n")
        node0.stdin.flush()
        assert node0.wait(60) == 0, _tail(log, node0)
        assert node1.wait(30) == 0  # node 0's Stop ended node 1's rank cleanly
    finally:
        for node in (node0, node1):
            if node.poll() is None:
                node.kill()
        log.close()
    return TwoNodeRun(json.loads(line.removeprefix("TOKENS ")), listening)


def _read_line(process: subprocess.Popen, prefix: str, timeout_s: float) -> str | None:
    """The first line of `process`'s stdout starting with `prefix`, or None (it exited or
    did not print one within timeout_s)."""
    found: list[str] = []

    def read() -> None:
        for line in process.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return found[0] if found else None


def _tail(log, process: subprocess.Popen) -> str:
    log.flush()
    log.seek(0)
    return f"node 0 (exit {process.poll()}): {log.read()[-3000:]}"


@pytest.mark.slow
def test_two_nodes_on_their_own_addresses_match_one_process(tiny_ckpt, reference, tmp_path):
    """PP=2 with each node on an address of its own, which its gloo listens on: in two
    network namespaces joined by a veth pair (10.77.0.1 <-> 10.77.0.2: every activation,
    step and rendezvous byte crosses it), or, where namespaces are unavailable (not root, no
    `ip`), over loopback with node 0 on 127.0.0.1 and node 1 on 127.0.0.2 (KILN_HOST_IP)."""
    path = tiny_ckpt("llama")
    why_not = namespaces_unavailable()
    if why_not is None:
        addresses = ADDRESSES
        with veth_namespaces():
            prefixes = tuple(("ip", "netns", "exec", ns) for ns in NAMESPACES)
            run = run_two_nodes(path, f"{ADDRESSES[0]}:29517", prefixes, ({}, {}), tmp_path)
    else:
        addresses = LOOPBACK_ADDRESSES
        if (no_loopback := loopback_unavailable()) is not None:
            pytest.skip(f"no network namespaces ({why_not}) and {no_loopback}")
        envs = tuple({"KILN_HOST_IP": address} for address in LOOPBACK_ADDRESSES)
        run = run_two_nodes(path, f"{LOOPBACK_ADDRESSES[0]}:{free_port()}", ((), ()), envs,
                            tmp_path)
    assert run.tokens == reference
    # each node's gloo listens on its own address only (the store listens on every address,
    # over IPv6's wildcard, which /proc/net/tcp does not list)
    assert run.listening == ({addresses[0]}, {addresses[1]})
