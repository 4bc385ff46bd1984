"""Training speculators on a tiny model: loss falls and acceptance rises; the CLI round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.spec.cli import register  # noqa: F401  (the command module imports cleanly)

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
    from kiln.spec.data import chunk_tokens, generate_answers, record_target
    from kiln.spec.eagle import EagleHead, save_head
    from kiln.spec.train import HeadTrainer, TrainConfig

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
    return out, before, history


def test_training_lowers_loss_and_raises_agreement(trained):
    _, before, history = trained
    first, last = sum(history.loss[:4]) / 4, sum(history.loss[-4:]) / 4
    assert last < 0.7 * first
    assert history.eval_accuracy[0] > before[0] + 0.2


def test_trained_head_is_accepted_more_and_stays_lossless(trained, llama_path):
    out, _, _ = trained
    reference = LLM(llama_path, dtype="float32", num_threads=1)
    expected = [o.outputs[0].token_ids for o in reference.generate(SEEDS[:4], GREEDY,
                                                                   use_tqdm=False)]
    rates = {}
    for name in ("untrained", "trained"):
        llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(out / name))
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
                 "--draft-layers", "1", "--dtype", "float32"]) == 0
    assert json.loads((draft / "speculator.json").read_text())["kind"] == "draft"
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(draft))
    assert llm.engine.speculator.config.method == "draft"
    assert (tmp_path / "home" / "speculators" / ".records").is_dir()
