"""Seeded workloads: lists of sessions, each an ordered list of turns.

Every workload but multi-turn makes one-turn sessions. A turn carries the messages it adds to
the conversation; the runner sends the whole conversation so far (earlier turns, the real
streamed replies, then this turn's messages), so multi-turn prompts grow turn by turn.
Token lengths are exact in the given tokenizer for each generated message content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from kiln.bench.config import WorkloadConfig, WorkloadKind
from kiln.bench.tokens import TextMaker, Tokenizer, count_tokens


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Turn:
    messages: tuple[Message, ...]  # appended to the conversation before this request
    input_tokens: int  # tokens of those messages' contents
    output_len: int  # max_tokens of the request


@dataclass(frozen=True)
class Session:
    session_id: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


Builder = Callable[[WorkloadConfig, int, TextMaker], list[Session]]


def build_workload(config: WorkloadConfig, num_requests: int, seed: int,
                   tokenizer: Tokenizer) -> Workload:
    """The sessions of `config`, seeded by `seed`, holding at most `num_requests` requests.

    random and long-context make exactly `num_requests`; the others have a natural count
    (groups x prompts, sessions x turns, lines), which `num_requests` may cut but not exceed.
    """
    maker = TextMaker(tokenizer, np.random.default_rng(seed))
    sessions = _BUILDERS[config.kind](config, num_requests, maker)
    return Workload(_cap(sessions, num_requests, config.kind))


def _cap(sessions: list[Session], limit: int, kind: WorkloadKind) -> tuple[Session, ...]:
    total = sum(len(s.turns) for s in sessions)
    if limit > total:
        raise ValueError(f"--num-requests {limit} exceeds the {total} requests the {kind.value} "
                         "workload defines; raise its sizes instead")
    kept: list[Session] = []
    for session in sessions:
        if limit <= 0:
            break
        kept.append(Session(session.session_id, session.turns[:limit]))
        limit -= len(kept[-1].turns)
    return tuple(kept)


def _lengths(maker: TextMaker, mean: int, ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    low = max(1, int(np.floor(mean * (1 - ratio))))
    high = max(low, int(np.ceil(mean * (1 + ratio))))
    return maker.rng.integers(low, high + 1, size=n).tolist()


def _user_turn(maker: TextMaker, input_len: int, output_len: int, after: str = "",
               system: str | None = None) -> Turn:
    messages = (Message("system", system),) if system else ()
    text = maker.text(input_len, after=after)
    system_tokens = count_tokens(maker.tokenizer, system) if system else 0
    return Turn(messages + (Message("user", text),), system_tokens + input_len, output_len)


def _random(config: WorkloadConfig, n: int, maker: TextMaker) -> list[Session]:
    ins = _lengths(maker, config.input_len, config.range_ratio, n)
    outs = _lengths(maker, config.output_len, config.range_ratio, n)
    return [Session(i, (_user_turn(maker, ins[i], outs[i]),)) for i in range(n)]


def _shared_prefix(config: WorkloadConfig, n: int, maker: TextMaker) -> list[Session]:
    """groups x prompts_per_group requests; the prompts of a group share a system prompt of
    system_len tokens. Requests are shuffled so groups interleave, as real traffic does."""
    total = config.groups * config.prompts_per_group
    ins = _lengths(maker, config.input_len, config.range_ratio, total)
    outs = _lengths(maker, config.output_len, config.range_ratio, total)
    turns: list[Turn] = []
    for _ in range(config.groups):
        prefix = maker.text(config.system_len)
        for _ in range(config.prompts_per_group):
            k = len(turns)
            turns.append(_user_turn(maker, ins[k], outs[k], after=prefix, system=prefix))
    order = maker.rng.permutation(total).tolist()
    return [Session(i, (turns[k],)) for i, k in enumerate(order)]


def _multi_turn(config: WorkloadConfig, n: int, maker: TextMaker) -> list[Session]:
    """Coding-agent sessions: one system prompt shared by all sessions (the agent's tools and
    rules), a long first user message (task plus code), then short follow-ups (tool output,
    corrections). The runner inserts each real reply before the next user message."""
    system = maker.text(config.system_len) or None
    return [_session(config, maker, sid, system) for sid in range(config.sessions)]


def _session(config: WorkloadConfig, maker: TextMaker, sid: int, system: str | None) -> Session:
    ins = _lengths(maker, config.input_len, config.range_ratio, config.turns)
    outs = _lengths(maker, config.output_len, config.range_ratio, config.turns)
    ins[0] = _lengths(maker, config.first_input_len, config.range_ratio, 1)[0]
    first = _user_turn(maker, ins[0], outs[0], after=system or "", system=system)
    rest = [_user_turn(maker, ins[t], outs[t]) for t in range(1, config.turns)]
    return Session(sid, (first, *rest))


def _long_context(config: WorkloadConfig, n: int, maker: TextMaker) -> list[Session]:
    return _random(config, n, maker)  # same shape; the defaults make prompts long and few


class _JsonlLine(msgspec.Struct, forbid_unknown_fields=False):
    prompt: str | None = None
    messages: list[Message] | None = None
    output_tokens: int | None = None
    max_tokens: int | None = None  # accepted as a synonym of output_tokens


def _jsonl(config: WorkloadConfig, n: int, maker: TextMaker) -> list[Session]:
    """One request per line: {"prompt": str} or {"messages": [{role, content}...]}, with an
    optional "output_tokens" (or "max_tokens"); lines without one use --output-len."""
    assert config.dataset is not None  # WorkloadConfig validates this
    path = Path(config.dataset)
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    return [Session(i, (_jsonl_turn(path, i, x, config, maker),)) for i, x in enumerate(lines)]


def _jsonl_turn(path: Path, index: int, line: str, config: WorkloadConfig,
                maker: TextMaker) -> Turn:
    try:
        row = msgspec.json.decode(line, type=_JsonlLine)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}:{index + 1}: {exc}") from None
    if (row.prompt is None) == (row.messages is None):
        raise ValueError(f"{path}:{index + 1}: give exactly one of 'prompt' and 'messages'")
    messages = tuple(row.messages or [Message("user", row.prompt or "")])
    output_len = row.output_tokens or row.max_tokens or config.output_len
    if output_len < 1:
        raise ValueError(f"{path}:{index + 1}: output_tokens must be >= 1")
    tokens = sum(count_tokens(maker.tokenizer, m.content) for m in messages)
    return Turn(messages, tokens, output_len)


_BUILDERS: dict[WorkloadKind, Builder] = {
    WorkloadKind.RANDOM: _random,
    WorkloadKind.SHARED_PREFIX: _shared_prefix,
    WorkloadKind.MULTI_TURN: _multi_turn,
    WorkloadKind.LONG_CONTEXT: _long_context,
    WorkloadKind.JSONL: _jsonl,
}


def default_num_requests(config: WorkloadConfig) -> int:
    """The request count a workload defines by its own sizes (groups x prompts, sessions x turns,
    lines of the file); random and long-context take any count and default to 100 and 8."""
    if config.kind is WorkloadKind.SHARED_PREFIX:
        return config.groups * config.prompts_per_group
    if config.kind is WorkloadKind.MULTI_TURN:
        return config.sessions * config.turns
    if config.kind is WorkloadKind.JSONL:
        assert config.dataset is not None
        return len([x for x in Path(config.dataset).read_text().splitlines() if x.strip()])
    return 8 if config.kind is WorkloadKind.LONG_CONTEXT else 100
