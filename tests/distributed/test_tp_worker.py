"""`kiln serve --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`): one worker of two
ranks serves; when its second rank is killed mid-request the worker fails fast, and the
gateway restarts it. Slow (a
gateway and a worker of two ranks start): `make test-all`; tests/distributed/
test_tensor_parallel.py kills a rank of an offline engine in the default suite."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.serve.conftest import start_server

pytestmark = pytest.mark.slow

LONG = {"prompt": "The quick brown fox " * 10, "max_tokens": 900, "temperature": 0,
        "extra_body": {"ignore_eos": True}}


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module", params=["--tensor-parallel-size", "--pipeline-parallel-size"])
def srv(llama_path, tmp_path_factory, request):
    s = start_server(llama_path, tmp_path_factory.mktemp("ranked-worker"), "--served-model-name",
                     "m", request.param, "2", "--dist-timeout", "20")
    yield s
    s.stop()


def test_a_killed_rank_restarts_the_worker(srv):
    client = srv.openai(timeout=60)
    assert client.completions.create(model="m", prompt="hi", max_tokens=4).usage \
        .completion_tokens == 4
    worker = srv.worker_pid()
    (rank1,) = children(worker)
    stream = client.completions.create(model="m", stream=True, **LONG)
    next(iter(stream))
    killed = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    with pytest.raises(openai.APIError):  # the stream ends with the lost worker's error
        for _ in stream:
            pass
    assert time.monotonic() - killed < 30
    srv.wait_health(200, timeout=120)
    assert srv.worker_pid() not in (None, worker)
    out = client.completions.create(model="m", prompt="back again", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert "RankFailure" in srv.log() and "a rank died" in srv.log()
