"""`kiln bench serve | plot | compare` end to end against fake servers, and result files."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kiln.bench.compare import RoundResult, summarize
from kiln.bench.config import SLO, BenchConfig, LoadConfig, ServerConfig
from kiln.bench.fakeserver import FakeServer, FakeServerSpec
from kiln.bench.metrics import RequestRecord, compute_metrics
from kiln.bench.plot import plot_results, series
from kiln.bench.result import SCHEMA, BenchResult, Environment, load_result, save_result
from kiln.cli import main
from kiln.testing.tiny import make_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(str(path))
    return str(path)


def serve_args(url: str, tokenizer_dir: str, out, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--model", "fake", "--tokenizer", tokenizer_dir,
            "--num-requests", "4", "--input-len", "16", "--output-len", "4", "--out", str(out),
            "--no-progress", *extra]


def test_serve_writes_a_result_file_and_plot_draws_it(tokenizer_dir, tmp_path, capsys):
    outs = []
    with FakeServer(FakeServerSpec(ttft_s=0.02, itl_s=0.01)) as fake:
        for c in (1, 2):
            outs.append(tmp_path / f"c{c}.json")
            args = serve_args(fake.base_url, tokenizer_dir, outs[-1], "--concurrency", str(c),
                              "--slo", "ttft=1000,tpot=1000")
            assert main(args) == 0
    assert "output throughput" in capsys.readouterr().out
    raw = json.loads(outs[0].read_text())
    assert set(raw) == {"schema", "config", "environment", "metrics", "records"}
    assert raw["schema"] == SCHEMA and len(raw["records"]) == 4
    assert raw["config"]["load"]["concurrency"] == 1
    assert raw["config"]["tokenizer"] == tokenizer_dir
    assert {"hostname", "cpu_count", "python", "kiln_version", "date"} <= set(raw["environment"])
    result = load_result(outs[1])
    assert result.metrics.completed == 4 and result.metrics.good_requests == 4
    png = tmp_path / "plot.png"
    assert main(["bench", "plot", *map(str, outs), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_compare_runs_alternating_rounds_and_reports_ratios(tokenizer_dir, tmp_path):
    out = tmp_path / "cmp.json"
    # B streams 4x slower over 12 tokens, so a side's run (0.13 s against 0.46 s a batch) is
    # long enough that scheduling jitter on a loaded machine cannot even out the throughputs
    with FakeServer(FakeServerSpec(ttft_s=0.02, itl_s=0.01)) as a, \
            FakeServer(FakeServerSpec(ttft_s=0.02, itl_s=0.04)) as b:
        args = ["bench", "compare", "--a", a.base_url, "--b", b.base_url, "--model", "fake",
                "--tokenizer", tokenizer_dir, "--concurrency", "2", "--num-requests", "4",
                "--input-len", "8", "--output-len", "12", "--rounds", "2", "--warmup", "0",
                "--no-progress", "--out", str(out)]
        assert main(args) == 0
        assert len(a.requests) == len(b.requests) == 8
        prompts_a = [{r["messages"][0]["content"] for r in half}
                     for half in (a.requests[:4], a.requests[4:])]
        prompts_b = [{r["messages"][0]["content"] for r in half}
                     for half in (b.requests[:4], b.requests[4:])]
        assert prompts_a == prompts_b  # the same prompts on both sides within a round
        assert not prompts_a[0] & prompts_a[1]  # and new prompts in the next round
    raw = json.loads(out.read_text())
    assert [(r["round"], r["side"]) for r in raw["rounds"]] == [(0, "a"), (0, "b"), (1, "b"),
                                                                (1, "a")]
    ratios = {row["name"]: row["ratio"] for row in raw["summary"]}
    assert 2.8 < ratios["TPOT p50"] < 5.2  # B streams at a quarter of A's speed
    assert ratios["output throughput"] < 1.0


def metrics_with(throughput_tokens: int, ttft: float):
    records = [RequestRecord(0, 0, 0, 0.0, 4, 8, ttft_s=ttft, e2e_s=ttft + 0.3,
                             itl_s=(0.1, 0.1, 0.1), prompt_tokens=8,
                             output_tokens=throughput_tokens)]
    return compute_metrics(records, duration_s=1.0, slo=SLO())


def test_compare_summary_is_the_ratio_of_medians():
    rounds = [RoundResult(0, "a", 0, metrics_with(100, 0.2)),
              RoundResult(0, "b", 0, metrics_with(220, 0.1)),
              RoundResult(1, "b", 1, metrics_with(200, 0.1)),
              RoundResult(1, "a", 1, metrics_with(120, 0.4)),
              RoundResult(2, "a", 2, metrics_with(110, 0.3)),
              RoundResult(2, "b", 2, metrics_with(240, 0.1))]
    rows = {row.name: row for row in summarize(rounds)}
    out = rows["output throughput"]
    assert (out.a, out.b, out.ratio) == (110, 220, 2.0)
    ttft = rows["TTFT p50"]
    assert ttft.a == pytest.approx(300.0) and ttft.ratio == pytest.approx(1 / 3)
    assert not ttft.higher_is_better and out.higher_is_better
    assert rows["goodput"].ratio is None  # no SLO on either side
    assert rows["failed requests"].ratio is None  # 0 / 0


def fake_result(concurrency: int, ttft: float) -> BenchResult:
    config = BenchConfig(ServerConfig("http://h:1", "m"),
                         LoadConfig(num_requests=2, concurrency=concurrency))
    records = tuple(RequestRecord(i, i, 0, 0.0, 3, 5, ttft_s=ttft * (i + 1), e2e_s=0.5,
                                  itl_s=(0.1, 0.1), prompt_tokens=5, output_tokens=3)
                    for i in range(2))
    return BenchResult(SCHEMA, config, Environment.capture(),
                       compute_metrics(records, 1.0 * concurrency, SLO()), records)


def test_result_round_trips_through_json(tmp_path):
    result = fake_result(2, 0.1)
    loaded = load_result(save_result(result, tmp_path / "r.json"))
    assert loaded.config == result.config and loaded.metrics == result.metrics
    assert loaded.records == result.records
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "nope"}')
    with pytest.raises(ValueError, match="not a kiln bench serve result"):
        load_result(bad)


def test_plot_groups_files_into_curves_by_load(tmp_path):
    results = [fake_result(4, 0.2), fake_result(1, 0.1),
               replace(fake_result(2, 0.1), config=replace(fake_result(2, 0.1).config,
                                                           label="other"))]
    curves = series(results)
    assert len(curves) == 2
    (main_curve,) = [group for name, group in curves.items() if "other" not in name]
    assert [r.config.load.concurrency for r in main_curve] == [1, 4]
    path = plot_results(results, tmp_path / "sub" / "p.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_bench_registers_its_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in ("serve", "plot", "compare"))


@pytest.mark.parametrize("extra,message", [
    (["--base-url", "ftp://x", "--concurrency", "1"], "--base-url"),
    (["--base-url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency"),
    (["--base-url", "http://127.0.0.1:9", "--rate", "1", "--slo", "ttft"], "--slo"),
    (["--base-url", "http://127.0.0.1:9", "--rate", "1", "--workload", "jsonl"], "--dataset"),
])
def test_user_errors_print_one_line(tokenizer_dir, tmp_path, capsys, extra, message):
    args = ["bench", "serve", "--model", "m", "--tokenizer", tokenizer_dir, "--out",
            str(tmp_path / "x.json"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("kiln bench: error:")


def test_unreachable_server_is_a_one_line_error(tokenizer_dir, tmp_path, capsys):
    with FakeServer() as fake:
        url = fake.base_url
    assert main(serve_args(url, tokenizer_dir, tmp_path / "x.json", "--concurrency", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "warm-up request" in err[-1] and "connection" in err[-1]


def test_cpu_summary_names_the_vector_extensions(tmp_path):
    from kiln.bench.result import cpu_summary

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512f "
                    "avx512_bf16\n")
    assert cpu_summary(str(info)) == {"model": "Test CPU",
                                      "extensions": ["avx2", "avx512f", "avx512_bf16"],
                                      "native_bf16": True}
    info.write_text("model name\t: Old CPU\nflags\t\t: fpu avx2\n")
    assert cpu_summary(str(info))["native_bf16"] is False
    assert cpu_summary(str(tmp_path / "missing"))["native_bf16"] is False
