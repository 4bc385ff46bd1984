"""`kiln --help` and every subcommand's `--help` (nested ones too) run, exit 0 and name their
flags; `kiln serve` and `kiln worker` list each config field's flag exactly once, with the
field's help and default; a command line without flags builds the dataclasses' defaults."""

from __future__ import annotations

import argparse
import re

import pytest

from kiln.cli import build_parser, main
from kiln.cluster.cli import default_worker_id, worker_config
from kiln.config import (
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    StructuredConfig,
    WorkerConfig,
)
from kiln.config_cli import flag_fields, flag_name
from kiln.config_fields import field_doc
from kiln.config_speculative import SpeculativeConfig
from kiln.serve.cli import PER_WORKER, configs

ENGINE_CONFIGS = [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, SpeculativeConfig,
                  StructuredConfig]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                  ) -> list[tuple[str, ...]]:
    paths = [path]
    for name, sub in subcommands(parser).items():
        paths += command_paths(sub, (*path, name))
    return paths


def parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(list(path))
    for name in path:
        parser = subcommands(parser)[name]
    return parser


COMMANDS = command_paths(build_parser([]))


def test_every_command_is_found():
    for path in [("serve",), ("worker",), ("generate",), ("bench", "serve"), ("quantize", "eval"),
                 ("models", "list"), ("train-speculator",)]:
        assert path in COMMANDS
    assert ("plan",) not in COMMANDS  # not built: not listed


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(("kiln", *path)))
def test_help_exits_0_and_names_every_flag(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    parser = parser_of(path)
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text, f"kiln {' '.join(path)} --help lacks {option}"
    for name in subcommands(parser):
        assert name in text


@pytest.mark.parametrize("command, config_types, skip", [
    ("serve", [*ENGINE_CONFIGS, WorkerConfig, ServeConfig, ClusterConfig], PER_WORKER),
    ("worker", [*ENGINE_CONFIGS, WorkerConfig], ()),
])
def test_each_config_field_is_one_flag_with_the_fields_help(command, config_types, skip,
                                                            monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping: a help reads as the field's
    parser = parser_of((command,))
    options = [option for action in parser._actions for option in action.option_strings]
    assert len(options) == len(set(options))
    text = parser.format_help()
    for cls in config_types:
        for f in flag_fields(cls, skip=skip if cls is WorkerConfig else ()):
            flag = flag_name(f)
            assert options.count(flag) == 1, flag
            assert len(re.findall(rf"^\s+{re.escape(flag)}(?=[ ,]|$)", text, re.M)) == 1, flag
            assert field_doc(f).help in text, flag
    assert "--transfer-host" in options if command == "worker" else "--transfer-host" not in options


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_no_flags_means_the_dataclasses_defaults():
    assert configs(parse("serve")) == (ServeConfig(), WorkerConfig())
    worker = worker_config(parse("worker", "--gateway", "tcp://127.0.0.1:5555"))
    assert worker == WorkerConfig(gateway_address="tcp://127.0.0.1:5555",
                                  worker_id=default_worker_id())
    assert worker.transfer_host == "127.0.0.1" and worker.advertise_host is None


def test_the_flags_users_type_keep_their_meaning():
    serve, worker = configs(parse(
        "serve", "--model", "m", "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory", "1000", "--no-prefix-caching", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--policy", "priority", "--quantization", "int8",
        "--threads", "3", "--heartbeat-interval", "0.2", "--repetition-guard", "off",
        "--grammar-compile-timeout", "2", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "a", "--api-key", "b", "--served-model-name", "s", "--pricing", "p.json",
        "--max-n", "2", "--max-top-logprobs", "5", "--max-body-bytes", "99",
        "--admission-queue-size", "7", "--shutdown-timeout", "5", "--no-restart",
        "--heartbeat-timeout", "9", "--access-log", "--tool-call-parser", "json",
        "--workers", "2", "--router", "round-robin", "--router-temperature", "0.5",
        "--prefill-weight", "2", "--disagg-min-tokens", "8", "--no-migration",
        "--max-migrations", "1", "--cluster-address", "tcp://127.0.0.1:5555"))
    engine = worker.engine
    assert engine == EngineConfig(
        model=ModelConfig(model="m", dtype="float32", max_model_len=512, quantization="int8"),
        cache=CacheConfig(kv_cache_memory=1000, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="priority"),
        parallel=ParallelConfig(num_threads=3),
        structured=StructuredConfig(repetition_guard="off", compile_timeout_s=2.0))
    assert worker.heartbeat_interval_s == 0.2
    assert serve == ServeConfig(
        host="0.0.0.0", port=9000, api_keys=("a", "b"), served_model_name="s",
        pricing_file="p.json", max_n=2, max_top_logprobs=5, max_body_bytes=99,
        admission_queue_size=7, shutdown_timeout_s=5.0, restart_worker=False,
        heartbeat_timeout_s=9.0, access_log=True, tool_call_parser="json",
        cluster=ClusterConfig(num_workers=2, router="round-robin", router_temperature=0.5,
                              prefill_weight=2.0, disagg_min_tokens=8, migration=False,
                              max_migrations=1, address="tcp://127.0.0.1:5555"))


def test_workers_spawned_together_split_the_cores_unless_told():
    _, worker = configs(parse("serve", "--prefill-workers", "1", "--decode-workers", "1"))
    assert worker.engine.parallel.num_threads is not None
    _, worker = configs(parse("serve", "--workers", "2", "--threads", "5"))
    assert worker.engine.parallel.num_threads == 5


def test_a_worker_bound_to_every_interface_advertises_the_one_towards_the_gateway():
    worker = worker_config(parse("worker", "--gateway", "tcp://127.0.0.1:5555",
                                 "--transfer-host", "0.0.0.0", "--role", "decode",
                                 "--worker-id", "w"))
    assert (worker.transfer_host, worker.advertise_host) == ("0.0.0.0", "127.0.0.1")
    assert (worker.role, worker.worker_id) == ("decode", "w")


def test_a_choice_outside_the_literal_is_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--dtype", "bf16"])
    assert done.value.code == 2
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
