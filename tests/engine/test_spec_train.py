"""Training speculators on a tiny model: loss falls and acceptance rises; the CLI round-trips."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config_speculative import SpeculativeConfig
from kiln.speculative.training.cli import register  # noqa: F401  (the command module imports cleanly)

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SEEDS = ["The quick brown fox", "def add(a, b):", "Paris is the capital", "0123456789",
         "Large language models", "class Point:", "the and of to in", '{"name": "kiln",',
         "Inference servers batch", "return a + b"]


def acceptance(llm: LLM, prompts: list[str]) -> float:
    before = llm.engine.speculator.stats
    drafts, accepted = before.num_draft_tokens, before.num_accepted_tokens
    llm.generate(prompts, GREEDY, use_tqdm=False)
    after = llm.engine.speculator.stats
    return (after.num_accepted_tokens - accepted) / max(1, after.num_draft_tokens - drafts)


@pytest.fixture(scope="module")
def trained(llama_path, tmp_path_factory):
    """A head trained on the tiny model's own greedy continuations of the traffic it will
    see (self-distillation: a random tiny model has no other structure a head could learn)."""
    from kiln.config import CacheConfig, ModelConfig, ParallelConfig
    from kiln.runner.model_runner import ModelRunner
    from kiln.speculative.head.model import EagleHead, save_head
    from kiln.speculative.training.data import chunk_tokens, generate_answers, record_target
    from kiln.speculative.training.train import HeadTrainer, TrainConfig

    # the random model's looping answers are the data: no repetition guard
    llm = LLM(llama_path, dtype="float32", num_threads=1, repetition_guard="off")
    docs = generate_answers(llm, SEEDS + [[3 + 7 * i] for i in range(38)], max_tokens=96)
    runner = ModelRunner(ModelConfig(model=llama_path, dtype="float32"), llama_path,
                         CacheConfig(), ParallelConfig(1), frozenset())
    record = record_target(runner, chunk_tokens(docs, 64), (-1,))
    cfg = TrainConfig(epochs=16, batch_size=8, lr=3e-3, draft_vocab_size=0, eval_fraction=0.2,
                      autocast=False)
    trainer = HeadTrainer(runner.model, record, cfg, "tiny")
    # "untrained" = a freshly initialized head, before any of the trainer's work
    untrained = EagleHead(trainer.head.c, trainer.head.draft_vocab).float()
    start, trainer.head = trainer.head, untrained
    before = trainer.evaluate()
    trainer.head = start
    history = trainer.fit()
    out = tmp_path_factory.mktemp("trained")
    save_head(trainer.head, out / "trained", torch.float32)
    save_head(untrained, out / "untrained", torch.float32)
    return out, before, history, runner.model, record


def test_training_lowers_loss_and_raises_agreement(trained):
    _, before, history, _, _ = trained
    first, last = sum(history.loss[:4]) / 4, sum(history.loss[-4:]) / 4
    assert last < 0.7 * first
    assert history.eval_accuracy[0] > before[0] + 0.2


def test_training_goes_on_from_a_trained_head(trained):
    """`init` (--init): the trainer starts where the saved head ended — its held-out
    agreement, its draft vocabulary — trains every unrolled step from the first optimizer
    step (no step-1 curriculum again), and refuses a head that reads other features."""
    from kiln.speculative.head.model import load_head
    from kiln.speculative.training.train import HeadTrainer, TrainConfig

    out, before, history, model, record = trained
    cfg = TrainConfig(epochs=1, batch_size=8, lr=1e-3, draft_vocab_size=0, eval_fraction=0.2,
                      autocast=False)
    head = load_head(out / "trained", torch.float32)
    trainer = HeadTrainer(model, record, cfg, "tiny", init=head)
    assert torch.equal(trainer.head.draft_vocab, head.draft_vocab)
    assert trainer.evaluate() == pytest.approx(history.eval_accuracy, abs=1e-4)
    assert trainer.evaluate()[0] > before[0] + 0.2
    more = trainer.fit()
    assert len(more.accuracy[0]) == cfg.ttt_steps  # all steps at once, not step 1 alone
    assert len(history.accuracy[0]) == 1
    assert more.loss[0] < 0.5 * history.loss[0]
    with pytest.raises(ValueError, match="feature layers"):
        HeadTrainer(model, record, TrainConfig(feature_layers=(0, -1), autocast=False), "tiny",
                    init=head)


def test_cli_init_errors_are_one_line(trained, llama_path, tmp_path, capsys):
    from kiln.cli import main

    out = trained[0]
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    common = ["train-speculator", "--model", llama_path, "--prompts", str(prompts)]
    assert main(common + ["--kind", "draft", "--out", str(tmp_path / "o"),
                          "--init", str(out / "trained")]) != 0
    assert "--init goes on training a head" in capsys.readouterr().err
    assert main(common + ["--kind", "head", "--out", str(tmp_path / "o"),
                          "--init", str(tmp_path)]) != 0
    assert "not a trained head" in capsys.readouterr().err
    assert main(common + ["--kind", "head", "--out", str(tmp_path / "o"), "--init",
                          str(out / "trained"), "--feature-layers", "0", "-1"]) != 0
    err = capsys.readouterr().err
    assert "reads feature layers [-1], not [0, -1]" in err and "Traceback" not in err


def test_trained_head_is_accepted_more_and_stays_lossless(trained, llama_path):
    out, _, _, _, _ = trained
    reference = LLM(llama_path, dtype="float32", num_threads=1)
    expected = [o.outputs[0].token_ids for o in reference.generate(SEEDS[:4], GREEDY,
                                                                   use_tqdm=False)]
    rates = {}
    for name in ("untrained", "trained"):
        # the head's own drafts (its default joins lookup's matches and trees), one per step
        # and forced: adaptive speculation drafts by measured step times, so the share of its
        # drafts accepted moves with the machine's load (0.125 in a loaded CI run, above 0.2
        # alone); the first draft step is the one a tiny head learns best
        llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(out / name),
                  speculative_config=SpeculativeConfig(ngram_first=False, tree_width=1,
                                                       adaptive=False, num_speculative_tokens=1))
        got = [o.outputs[0].token_ids for o in llm.generate(SEEDS[:4], GREEDY, use_tqdm=False)]
        assert got == expected
        rates[name] = acceptance(llm, SEEDS[:4])
    assert rates["trained"] > rates["untrained"] + 0.2, rates


def test_cli_trains_a_head_from_prompts(llama_path, tmp_path, monkeypatch):
    from kiln.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": s}) for s in SEEDS[:4]) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    head = tmp_path / "head"
    assert main(["train-speculator", "--model", llama_path, "--prompts", str(prompts),
                 "--kind", "head", "--out", str(head), "--seq-len", "32", "--epochs", "1",
                 "--answer-tokens", "24", "--max-tokens", "512", "--dtype", "float32"]) == 0
    assert {"head.safetensors", "speculator.json", "loss.png", "train.json"} <= {
        p.name for p in head.iterdir()}
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(head))
    assert llm.engine.speculator.config.method == "head"


@pytest.mark.slow  # imports transformers' model code and trains a full-vocabulary model
def test_cli_distills_a_draft_model_from_files(llama_path, tmp_path, monkeypatch):
    from kiln.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))  # the record cache goes there
    data = tmp_path / "data.txt"
    data.write_text(" ".join(SEEDS) * 20)
    draft = tmp_path / "draft"
    assert main(["train-speculator", "--model", llama_path, "--data", str(data), "--kind",
                 "draft", "--out", str(draft), "--seq-len", "32", "--epochs", "1",
                 "--draft-layers", "1", "--draft-vocab-size", "64", "--dtype", "float32"]) == 0
    meta = json.loads((draft / "speculator.json").read_text())
    assert meta["kind"] == "draft" and len(meta["draft_vocab"]) == 64
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(draft))
    assert llm.engine.speculator.config.method == "draft"
    assert (tmp_path / "home" / "speculators" / ".records").is_dir()


def test_continuation_prompts_are_seeded_windows_round_robin():
    from kiln.speculative.training.data import continuation_prompts

    docs = [list(range(100, 140)), list(range(200, 210)), list(range(300, 304))]
    got = continuation_prompts(docs, 7, 8, seed=1)
    assert got == continuation_prompts(docs, 7, 8, seed=1)
    assert len(got) == 7 and all(len(w) == 8 for w in got)
    # each window is a contiguous slice of one document; documents alternate (the 4-token
    # one is too short to give a prompt)
    owners = [w[0] // 100 for w in got]
    assert owners == [1, 2, 1, 2, 1, 2, 1]
    assert all(w == list(range(w[0], w[0] + 8)) for w in got)
    assert continuation_prompts(docs, 100, 8) and len(continuation_prompts(docs, 100, 8)) < 100
    with pytest.raises(ValueError, match="no document"):
        continuation_prompts([[1, 2]], 3, 8)


def test_continue_openings_continues_each_seeded_window(llama_path):
    """The presets' self-distillation: each seeded window of the texts, then exactly
    `answer_tokens` of the target's own; in slices of whole batches, progress after each."""
    from kiln.speculative.training.data import (
        continuation_prompts,
        continue_openings,
        tokenize_documents,
    )

    llm = LLM(llama_path, dtype="float32", num_threads=1, repetition_guard="off")
    tok = llm.get_tokenizer()
    texts = [" ".join(SEEDS) * 3, " ".join(reversed(SEEDS)) * 2]
    calls: list[tuple[int, int]] = []
    got = continue_openings(llm, tok, texts, 5, 8, 6, seed=2,
                            progress=lambda done, total: calls.append((done, total)), batch=2)
    windows = continuation_prompts(tokenize_documents(tok, texts), 5, 8, seed=2)
    assert [seq[:8] for seq in got] == windows and len(set(map(tuple, windows))) == 5
    assert all(len(seq) == 14 for seq in got)
    assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)]


def test_cli_self_distills_from_files(llama_path, tmp_path, monkeypatch, capsys):
    """--self-distill: openings cut from the files, continued by the target; each training
    sequence is one opening plus its continuation (the continuation is the target's own
    greedy text, so its labels agree with its next tokens)."""
    from kiln.cli import main
    from kiln.speculative.training.data import TargetRecord

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    data = tmp_path / "data.txt"
    data.write_text(" ".join(SEEDS) * 10)
    head = tmp_path / "head"
    assert main(["train-speculator", "--model", llama_path, "--data", str(data), "--kind",
                 "head", "--out", str(head), "--self-distill", "--prompt-tokens", "8",
                 "--answer-tokens", "24", "--max-tokens", "256", "--epochs", "1",
                 "--dtype", "float32"]) == 0
    err = capsys.readouterr().err  # progress in a log
    assert "continued 8/8 openings" in err and "recorded 256/256 tokens" in err
    (cached,) = (tmp_path / "home" / "speculators" / ".records").iterdir()
    record = TargetRecord.load(cached)
    assert record.tokens.shape == (8, 32)
    # the target's choice after position p is the token at p + 1, from the last prompt token
    assert torch.equal(record.labels[:, 7:31], record.tokens[:, 8:32])
    assert json.loads((head / "train.json").read_text())["command"]["self_distill"] is True


def test_cli_preset_later_stages_go_on_from_the_one_before(llama_path, tmp_path, monkeypatch,
                                                          capsys):
    """A preset with `Refine` stages trains its head (kept under .stages), then goes on
    training it stage after stage on fresh, shorter continuations, the last into --out; a
    kept stage is taken as it is when the same command trained it before on the stages
    before it as they are, and trained again when one of those was."""
    from safetensors.torch import load_file

    from kiln.cli import main
    from kiln.speculative.training import cli, data

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(data, "domain_corpus", lambda domain: [" ".join(SEEDS) * 10])
    monkeypatch.setitem(cli.PRESETS, "code-head", cli.Preset("code", "head", 256, 1, tuple(
        cli.Refine(answer_tokens=8, tokens=8 * 16, seed=seed, epochs=1, lr=1e-3)
        for seed in (1, 2))))
    out = tmp_path / "head"
    command = ["train-speculator", "--preset", "code-head", "--model", llama_path,
               "--prompt-tokens", "8", "--answer-tokens", "24", "--dtype", "float32",
               "--out", str(out)]
    assert main(command) == 0
    stages = tmp_path / "home" / "speculators" / ".stages"
    first, second = stages / "code-head-1", stages / "code-head-2"
    meta = json.loads((out / "train.json").read_text())
    # train.json ships with a head: no machine's paths, the stages under $KILN_HOME by name
    assert str(tmp_path) not in (out / "train.json").read_text()
    kept_first, kept_second = (f"$KILN_HOME/speculators/.stages/{d.name}" for d in (first, second))
    assert meta["target"] == pathlib.Path(llama_path).name and meta["command"]["out"] == out.name
    assert meta["command"]["init"] == kept_second
    assert (meta["command"]["seed"], meta["command"]["answer_tokens"],
            meta["command"]["max_tokens"], meta["command"]["epochs"]) == (2, 8, 128, 1)
    middle = meta["previous_stage"]["command"]
    assert (middle["seed"], middle["init"], middle["out"]) == (1, kept_first, kept_second)
    before = meta["previous_stage"]["previous_stage"]["command"]
    assert (before["seed"], before["answer_tokens"], before["max_tokens"]) == (0, 24, 256)
    assert before["out"] == kept_first and before["init"] is None
    shapes = sorted(data.TargetRecord.load(p).tokens.shape[1]
                    for p in (tmp_path / "home" / "speculators" / ".records").iterdir())
    assert shapes == [16, 16, 32]  # openings of 8 continued for 24, then twice for 8
    heads = [load_file(d / "head.safetensors") for d in (first, second, out)]
    assert heads[0].keys() == heads[1].keys() == heads[2].keys()
    for a, b in zip(heads, heads[1:], strict=False):  # every later stage trained it
        assert any(not torch.equal(a[k], b[k]) for k in a)

    def stamps():
        return [(d / "head.safetensors").stat().st_mtime_ns for d in (first, second)]

    kept = stamps()
    capsys.readouterr()
    assert main(command) == 0
    err = capsys.readouterr().err
    assert "stage 1 of code-head" in err and "stage 2 of code-head" in err
    assert err.count("trained by this command before") == 2
    assert stamps() == kept
    (first / "train.json").unlink()  # stage 1 is trained again, so stage 2 is too
    assert main(command) == 0
    assert "trained by this command before" not in capsys.readouterr().err
    assert all(a != b for a, b in zip(stamps(), kept, strict=True))


def test_cli_rejects_self_distill_of_prompts(llama_path, tmp_path, capsys):
    from kiln.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert main(["train-speculator", "--model", llama_path, "--prompts", str(prompts),
                 "--self-distill", "--kind", "head", "--out", str(tmp_path / "o")]) != 0
    assert "--self-distill" in capsys.readouterr().err


def test_autocast_follows_the_cpu_unless_set():
    """bf16 autocast by default only where the CPU has bf16 arithmetic (emulated bf16 matmuls
    run several times slower than fp32 ones); an explicit setting wins."""
    from kiln.kernels.bf16_mm import onednn_available
    from kiln.speculative.training.train import TrainConfig, bf16_autocast

    for setting, expected in ((None, onednn_available(torch.bfloat16)), (True, True),
                              (False, False)):
        with bf16_autocast(TrainConfig(autocast=setting)):
            assert torch.is_autocast_enabled("cpu") == expected
