"""How close bf16 stays to fp32, for kiln and for HF transformers on the same weights and machine.

Two figures, each computed for both engines (tests/engine/test_fidelity.py asserts kiln's is at
least as good as HF's; benchmarks/fidelity.py records them with the CPU's model and ISA):

- agreement: over QUESTIONS (short chat questions), how many greedy answers of
  `ANSWER_TOKENS` tokens in bf16 equal the same engine's answers in fp32;
- KL: the mean KL(fp32 || bf16) of next-token distributions over HELD_OUT (text neither
  engine is tuned on), teacher-forced, position by position.

Both engines read the same token ids (the model's chat template rendered once by the
tokenizer), so only their arithmetic differs.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch

ANSWER_TOKENS = 16

README_QUESTION = "What is the capital of France?"
README_ANSWER = "The capital of France is Paris."

QUESTIONS = (
    README_QUESTION,
    "What is the largest planet in the solar system?",
    "Who wrote the play Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "How many continents are there on Earth?",
    "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "What is the square root of 81?",
    "Who painted the Mona Lisa?",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is the fastest land animal?",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Which planet is known as the Red Planet?",
    "What is the tallest mountain in the world?",
    "How many days are there in a leap year?",
    "What is the main ingredient of guacamole?",
    "Who discovered penicillin?",
    "What is the capital of Italy?",
    "What is the hardest natural substance?",
    "How many sides does a hexagon have?",
    "What do bees make?",
    "What is the longest river in Africa?",
    "Which organ pumps blood through the body?",
    "What is the currency of the United Kingdom?",
    "What is the smallest prime number?",
    "Who was the first person to walk on the Moon?",
    "What is the capital of Canada?",
    "What color do you get by mixing blue and yellow?",
    "How many minutes are there in an hour?",
    "What is the largest mammal on Earth?",
    "What instrument has 88 keys?",
    "What is the opposite of hot?",
    "Which country is home to the kangaroo?",
    "What is H2O commonly called?",
    "How many strings does a standard guitar have?",
    "What is the capital of Germany?",
    "Which season comes after winter?",
    "What is the primary language of Mexico?",
    "How many hours are there in a day?",
)

HELD_OUT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a "
    "small can of oil, a cloth and a notebook in which he wrote the weather, the ships he saw "
    "and anything else that seemed worth remembering. Over forty years the notebooks filled a "
    "whole shelf in the kitchen below.",
    "To make bread, mix flour, water, salt and a little yeast until the dough comes together. "
    "Knead it for ten minutes, then leave it covered in a warm place until it has doubled in "
    "size. Shape the loaf, let it rise again, and bake it in a hot oven until the crust is "
    "brown and the bottom sounds hollow when tapped.",
    "A binary search looks for a value in a sorted list by comparing it with the middle "
    "element. If the value is smaller, the search continues in the left half; if larger, in "
    "the right half. Each step halves the range, so a list of a million items needs at most "
    "about twenty comparisons.",
    "The committee met on Tuesday to discuss the budget for the coming year. Several members "
    "argued that the library should receive more money for new books, while others wanted to "
    "repair the roof of the town hall first. In the end they agreed to split the difference "
    "and to meet again in the spring.",
)


@dataclass(frozen=True)
class Fidelity:
    """One engine's bf16-vs-fp32 figures."""

    engine: str
    agreement: int  # answers equal in bf16 and fp32, out of `questions`
    questions: int
    mean_kl: float  # mean KL(fp32 || bf16) per held-out position, nats
    readme_answer: str  # the bf16 answer to README_QUESTION


def prompt_ids(path: str | Path) -> list[list[int]]:
    """Every question as chat-template token ids (the same ids for both engines)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in QUESTIONS]


def held_out_ids(path: str | Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok(text)["input_ids"] for text in HELD_OUT]


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over all rows of KL(reference || other), both given as log-probabilities [L, V]."""
    ref, oth = torch.cat(reference).double(), torch.cat(other).double()
    return float((ref.exp() * (ref - oth)).sum(dim=-1).mean())


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


# -- kiln --------------------------------------------------------------------------------------


def kiln_answers(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers of ANSWER_TOKENS tokens (or to EOS), all prompts in one generate call."""
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def kiln_log_probs(llm, texts: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced next-token log-probabilities [L, V] of each text (the engine's model and
    attention backend, as a prefill runs them)."""
    from kiln.runner.scoring import TeacherForcer

    out = []
    for ids in texts:
        forcer = TeacherForcer(llm.engine.runner.model, torch.tensor([ids]), windows_per_step=1)
        step = forcer.steps[0]
        out.append(forcer.log_probs(forcer.forward(step)))
    return out


def kiln_fidelity(path: str | Path, **settings) -> tuple[Fidelity, dict]:
    """kiln's figures (bf16 with `settings`, e.g. kernels="cpp", against fp32)."""
    from kiln import LLM

    prompts, texts = prompt_ids(path), held_out_ids(path)
    answers, log_probs = {}, {}
    for dtype in ("float32", "bfloat16"):
        gc.collect()  # an engine left alive (a reference cycle) slows the next one severalfold
        llm = LLM(str(path), dtype=dtype, max_model_len=512, max_num_seqs=len(prompts),
                  **settings)
        answers[dtype] = kiln_answers(llm, prompts)
        log_probs[dtype] = kiln_log_probs(llm, texts)
        tokenizer = llm.tokenizer
        del llm
    result = Fidelity("kiln", agreement(answers["bfloat16"], answers["float32"]), len(prompts),
                      mean_kl(log_probs["float32"], log_probs["bfloat16"]),
                      tokenizer.decode(answers["bfloat16"][0], skip_special_tokens=True))
    return result, answers


# -- HF transformers ---------------------------------------------------------------------------


def hf_answers(model, prompts: list[list[int]], pad_id: int) -> list[list[int]]:
    """Greedy answers, the prompts batched with left padding; each cut at its first EOS (as
    kiln stops there)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=ANSWER_TOKENS,
                             do_sample=False, pad_token_id=pad_id)[:, width:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [_cut_at_eos(row, eos) for row in out]


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def hf_log_probs(model, texts: list[list[int]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
                for ids in texts]


def hf_fidelity(path: str | Path) -> tuple[Fidelity, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts, texts = prompt_ids(path), held_out_ids(path)
    answers, log_probs = {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        answers[name] = hf_answers(model, prompts, pad_id)
        log_probs[name] = hf_log_probs(model, texts)
        del model
        gc.collect()
    result = Fidelity("hf", agreement(answers["bfloat16"], answers["float32"]), len(prompts),
                      mean_kl(log_probs["float32"], log_probs["bfloat16"]),
                      tok.decode(answers["bfloat16"][0], skip_special_tokens=True))
    return result, answers
