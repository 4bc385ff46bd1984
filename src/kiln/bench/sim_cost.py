"""The simulator's cost model: how long one engine step takes, fitted to measured steps.

    step_s = base + prefill_token * P + prefill_attention * A + decode_seq * D + context * C

P = prompt tokens computed in the step; A = the sum of their positions (their attention over
the prefix, so a chunk's cost grows with where it starts); D = sequences decoding one token;
C = the context tokens those sequences attend to. `gateway_s` is added once to a request's
TTFT and E2E (HTTP, tokenization, IPC). `kiln bench sim-fit` times every step of a sweep on a
real engine (`measure_steps`) and fits the coefficients (`fit_cost_model`: least squares on
relative error, all coefficients >= 0).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kiln.engine.scheduler import SchedulerOutput
from kiln.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    prefill_attention: float = 0.0
    decode_seqs: int = 0
    context_tokens: int = 0

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.prefill_attention, self.decode_seqs,
                self.context_tokens]


def step_shape(sched: SchedulerOutput) -> StepShape:
    p, a, d, c = 0, 0.0, 0, 0
    for item in sched.scheduled:
        n = len(item.token_ids)
        if n == 1 and item.start_pos >= len(item.prompt_token_ids):
            d, c = d + 1, c + item.start_pos + 1
        else:
            p, a = p + n, a + n * (item.start_pos + n / 2)
    return StepShape(p, a, d, c)


@dataclass(frozen=True)
class CostModel:
    base_s: float
    prefill_token_s: float
    prefill_attention_s: float
    decode_seq_s: float
    context_token_s: float
    gateway_s: float = 0.003
    source: str = "builtin: SmolLM2-135M bf16, 1 thread, this project's 2-vCPU box"

    def step_s(self, shape: StepShape) -> float:
        coef = (self.base_s, self.prefill_token_s, self.prefill_attention_s, self.decode_seq_s,
                self.context_token_s)
        return float(sum(c * x for c, x in zip(coef, shape.features(), strict=True)))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostModel:
        return cls(**json.loads(path.read_text()))


BUILTIN = CostModel(  # `kiln bench sim-fit --threads 1` on the bundled model (bf16), 2026-11-30
    base_s=0.0148, prefill_token_s=0.00114, prefill_attention_s=3.35e-6, decode_seq_s=0.00133,
    context_token_s=1.29e-5)


def fit_cost_model(samples: list[tuple[StepShape, float]], source: str,
                   gateway_s: float = 0.003) -> CostModel:
    """Least squares on relative error with every coefficient >= 0 (columns that come out
    negative are dropped and the rest refitted: more work is never predicted to be faster)."""
    y = np.array([t for _, t in samples])
    x = np.array([s.features() for s, _ in samples]) / y[:, None]  # rows weighted by 1/t:
    ones = np.ones_like(y)  # minimizes relative error, so short decode steps count as much
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], ones, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active = [c for c, v in zip(active, coef, strict=True) if v >= 0]
    full = [0.0] * x.shape[1]
    for c, v in zip(active, coef, strict=True):
        full[c] = max(float(v), 0.0)
    return CostModel(*full, gateway_s=gateway_s, source=source)


def model_error(model: CostModel, samples: list[tuple[StepShape, float]]) -> float:
    """Median relative error of predicted vs measured step time."""
    errors = [abs(model.step_s(s) - t) / t for s, t in samples if t > 0]
    return float(np.median(errors))


def measure_steps(model: str | None, dtype: str, threads: int,
                  ) -> tuple[list[tuple[StepShape, float]], str]:
    """Time every step of a sweep on a real engine: single prompts of 16..2048 tokens, then
    batches of 1..64 sequences decoding over 64- and 512-token contexts."""
    from kiln.assembly import build_engine_core
    from kiln.config import EngineConfig, ModelConfig, ParallelConfig
    from kiln.engine.core import EngineRequest

    engine = build_engine_core(EngineConfig(model=ModelConfig(model=model, dtype=dtype),
                                            parallel=ParallelConfig(num_threads=threads)))
    samples: list[tuple[StepShape, float]] = []
    execute = engine.runner.execute

    def timed(sched: SchedulerOutput):
        started = time.perf_counter()
        out = execute(sched)
        samples.append((step_shape(sched), time.perf_counter() - started))
        return out

    engine.runner.execute = timed
    rng = np.random.default_rng(0)
    limit, seqs = engine.max_model_len - 32, engine.config.scheduler.max_num_seqs
    sweep = [(1, n, 1) for n in (16, 64, 256, 512, 1024, 2048) if n <= limit]
    sweep += [(b, c, 16) for b in (1, 4, 16, 32, 64) for c in (64, 512) if b <= seqs and c <= limit]
    for k, (batch, prompt_len, out_len) in enumerate([sweep[0], *sweep]):  # the first: warm-up
        for i in range(batch):
            engine.add_request(EngineRequest(
                request_id=f"fit-{k}-{i}", params=SamplingParams(
                    max_tokens=out_len, temperature=0, ignore_eos=True),
                prompt_token_ids=rng.integers(0, engine.vocab_size, prompt_len).tolist()))
        while engine.has_unfinished():
            engine.step()
        if k == 0:
            samples.clear()
    source = (f"{Path(engine.model_path).name} {dtype}, {threads} thread(s), "
              f"measured {time.strftime('%Y-%m-%d')}")
    return samples, source
