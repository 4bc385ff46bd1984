"""The engine's structured side: grammars for the requests that ask for one, the repetition
guard for all, and a verdict on every sampled token.

`EngineCore` owns one `StructuredHooks` (built by `kiln.assembly`; the engine's side of the
seam is `kiln.engine.core.StructuredOutput`) and wires it in:
  attach(request)               on arrival: start the grammar's compile, set up the guard
  check_token(request, token)   the scheduler's `TokenChecker`: each sampled token, before the
                                scheduler appends it (advance the grammar, run the guard)
  draft_filter(request, drafts) `Speculator.draft_filter`: leading drafts the grammar allows
  validate(params)              compile now (the offline LLM checks before adding anything)
  wait_for_compile(timeout_s)   the step had nothing to run but grammars compile: wait a bit
The tokenizer (token texts for the guard, xgrammar's TokenizerInfo) loads while the engine
loads the model (`Vocabulary.load_in_background`), so no step ever waits for it.
"""

from __future__ import annotations

import concurrent.futures
import logging

from kiln.config import StructuredConfig
from kiln.engine.limits import RequestError
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import KEEP, TokenCheck
from kiln.sampling_params import SamplingParams
from kiln.structured.closing import ClosingPlan, SteerMasks, closing_plan, margin, tokens_to_close
from kiln.structured.compiler import GrammarCompiler
from kiln.structured.constraint import TokenConstraint
from kiln.structured.grammar_spec import GrammarError, GrammarSpec, grammar_spec
from kiln.structured.guard import GuardState, guard_settings
from kiln.structured.json_limits import Breach, JsonShape, limits_for_schema, tag_json_begins
from kiln.structured.vocab import Vocabulary

log = logging.getLogger(__name__)
LOOPS_BEFORE_CLOSING = 4  # masked loops in a JSON request before a looping string must close


REDRAW = TokenCheck(keep=False)


class StructuredHooks:
    def __init__(self, config: StructuredConfig, vocab: Vocabulary | None,
                 eos_token_ids: frozenset[int]):
        """`vocab`: the model's (`Vocabulary.load_in_background` while the model loads);
        None without a tokenizer: no guard, and grammars fail saying so."""
        self.config = config
        self._vocab = vocab
        self._stop_ids = sorted(eos_token_ids)
        self.compiler = GrammarCompiler(self._tokenizer_info, config)
        self.num_guard_stops = 0
        self.num_redraws = 0
        self.num_interventions = 0  # masked redraws in constrained requests (_intervene)
        self.num_closings = 0  # constrained requests steered to close their JSON in budget
        self._steer_masks: SteerMasks | None = None

    def vocab(self) -> Vocabulary | None:
        return self._vocab

    def _tokenizer_info(self):
        if self._vocab is None:
            raise GrammarError("this model has no tokenizer to build grammars with")
        return self._vocab.tokenizer_info()

    # -- requests -----------------------------------------------------------------------------

    def attach(self, request: Request) -> None:
        """Give a new request its grammar (compiling in the background) and its guard."""
        params = request.params
        spec = None
        if params.structured_outputs is not None:
            spec = grammar_spec(params.structured_outputs)
            request.grammar = TokenConstraint(self.compiler.submit(spec), self._stop_ids,
                                              replay=request.output_token_ids,
                                              utf8=lambda: self._vocab.utf8)
        settings = guard_settings(params.repetition_guard, self.default_guard_mode(params))
        if settings.mode != "off":
            request.guard = GuardState(settings, json_shape(spec, request.output_token_ids,
                                                            self._vocab), json_closing(spec))

    def default_guard_mode(self, params: SamplingParams) -> str:
        """The engine's mode, except with ignore_eos: the client asked for exactly max_tokens
        tokens (benchmarks, tests), so the guard is off unless the request names a mode."""
        return "off" if params.ignore_eos else self.config.repetition_guard

    def validate(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (RequestError naming why it cannot be used)."""
        if params.structured_outputs is None:
            return
        try:
            self.compiler.compile(grammar_spec(params.structured_outputs))
        except GrammarError as exc:
            raise RequestError(str(exc), param="structured_outputs", code=exc.code) from exc

    def wait_for_compile(self, timeout_s: float) -> None:
        pending = self.compiler.inflight()
        if pending:
            concurrent.futures.wait(pending, timeout_s, concurrent.futures.FIRST_COMPLETED)

    # -- tokens ---------------------------------------------------------------------------------

    def check_token(self, request: Request, token: int) -> TokenCheck:
        """Judge `token`, sampled for `request` (not yet appended): run the guard, then
        advance the grammar. Finishing statuses: repetition (guard), stop (the grammar
        terminated), error (the grammar rejected the token; masks make that a bug). In a
        constrained request the guard masks instead of stopping (`_intervene`). `steered`:
        the closing budget narrowed the draw of `token` (reported per request, never silent)."""
        constraint = request.grammar
        banned = constraint.banned if constraint is not None else []
        steered = constraint is not None and constraint.steered  # drawn narrowed to close
        if constraint is not None:
            constraint.banned, constraint.steered = [], False
        status = None
        ahead = None  # the output's JSON shape with `token`, worked out once per token
        if request.guard is not None and token not in banned:  # a ban the grammar overruled
            loops = self._trips(request, token)
            ahead, breach = self._json_ahead(request, token)
            if loops or breach is not None:
                masked = self._intervene(request, token, banned, loops, breach)
                if masked is not None:
                    return masked
            if loops:
                if request.guard.take_redraw():
                    self.num_redraws += 1
                    self._ban(request, [token])
                    return REDRAW
                self.num_guard_stops += 1
                status = RequestStatus.FINISHED_REPETITION
        if constraint is not None and constraint.matcher is not None:
            if not constraint.accept(token):
                request.stop_reason = f"the grammar rejected token {token}"
                return TokenCheck(status=RequestStatus.FINISHED_ERROR)
            if request.guard is not None and request.guard.json is not None:
                if ahead is None:
                    ahead = request.guard.json
                    ahead.feed(self._vocab.text(token))
                request.guard.json = ahead
                constraint.steer = self._closing_steer(request)
            if status is None and constraint.terminated:
                status = RequestStatus.FINISHED_STOPPED
        return TokenCheck(status=status, steered=steered) if status is not None or steered \
            else KEEP

    def _json_ahead(self, request: Request, token: int) -> tuple[JsonShape | None,
                                                                  tuple[Breach, str] | None]:
        """In a grammar-constrained request with JSON limits: the JSON shape after `token` (a
        fork: the request's own shape moves only once the token is kept) and the bound it
        breaks, if any; (None, None) otherwise."""
        constraint, guard = request.grammar, request.guard
        if (constraint is None or constraint.matcher is None or self._vocab is None
                or guard.json is None):
            return None, None
        ahead = guard.json.fork()
        return ahead, ahead.feed(self._vocab.text(token))

    def _intervene(self, request: Request, token: int, banned: list[int], loops: bool,
                   breach: tuple[Breach, str] | None) -> TokenCheck | None:
        """In a grammar-constrained request, REDRAW with `token` banned (and the tokens that
        would do the same) when it would break a JSON limit (`breach`) or continue a loop
        (`loops`: the guard tripped), so the grammar's other continuations win and the output
        ends valid; None otherwise."""
        constraint, guard = request.grammar, request.guard
        if constraint is None or constraint.matcher is None or self._vocab is None:
            return None
        ban = self._breach_ban(request, token, breach) if breach is not None else None
        if ban is None and loops:
            ban = [token]
            if guard.json is not None and guard.json.in_string and \
                    guard.interventions >= LOOPS_BEFORE_CLOSING:
                ban += self._vocab.not_closing_string()  # a string that keeps looping ends
        if ban is None or not guard.take_intervention():
            return None
        self.num_interventions += 1
        self._ban(request, banned + ban)
        return REDRAW

    def _breach_ban(self, request: Request, token: int, breach: tuple[Breach, str]) -> list[int]:
        """The tokens banned for the redraw after `token` broke a bound: it and the tokens
        that would break it the same way. A token that closes the third copy of a string and
        adds `,` (`",`) may close it, but then the array or object must end: banning only the
        token would make the model write on in the string (`"x","x","xex"`), a new loop."""
        kind, char = breach
        vocab = self._vocab
        if kind.ends_container and request.guard.json.in_string and \
                vocab.text(token).startswith('"'):
            return [token] + vocab.not_closing_string() + vocab.closing_then(",")
        starts = kind.banned_starts(char)
        return [token] + (vocab.starting_with(starts) if starts else vocab.not_closing_string())

    def _closing_steer(self, request: Request) -> tuple:
        """The classes the next draws are narrowed to so that the JSON closes within
        max_tokens (kiln.structured.closing); () while the budget is ample. Called with the
        token being kept not yet appended."""
        guard, max_tokens = request.guard, request.params.max_tokens
        if guard.closing is None or max_tokens is None:
            return ()
        left = max_tokens - len(request.output_token_ids) - 1  # draws after this token
        estimate = self._tokens_to_close(guard)
        if estimate is None:
            return ()
        needed, jump = estimate
        reserve = needed + margin(needed)
        if left > reserve + jump:
            return ()  # even a token that opens something new leaves room to close it
        if not guard.closing_steps:
            self.num_closings += 1
        guard.closing_steps += 1
        if self._steer_masks is None:
            self._steer_masks = SteerMasks(self._vocab.texts, self._stop_ids)
        return self._steer_masks.for_shape(guard.json, now=left <= reserve)

    def _tokens_to_close(self, guard: GuardState) -> tuple[int, int] | None:
        """(at most the tokens the shortest completion of the JSON costs, end-of-sequence
        included, kiln.structured.closing.tokens_to_close; the schema's `jump`), cached per
        structural state of the output: string characters never change it. None, and no
        closing budget for the request from then on, if the estimate cannot read the
        schema."""
        shape = guard.json
        if guard.estimate is None or guard.estimate[0] != shape.version:
            try:
                needed = tokens_to_close(guard.closing, shape)
                guard.estimate = (shape.version, needed, guard.closing.jump)
            except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
                log.debug("no closing budget for this schema: %r", exc)  # odd but compiled
                guard.closing = None
                return None
        return guard.estimate[1], guard.estimate[2]

    def _trips(self, request: Request, token: int) -> bool:
        vocab = self._vocab
        if vocab is None or not 0 <= token < len(vocab.filler):
            return False
        if request.guard.check(request.output_token_ids, token, vocab.filler) is None:
            return False
        constraint = request.grammar
        return constraint is None or not constraint.forces(vocab.text(token))

    def _ban(self, request: Request, tokens: list[int]) -> None:
        if request.grammar is None:
            request.grammar = TokenConstraint()
        request.grammar.banned = tokens

    def draft_filter(self, request: Request, drafts: list[int]) -> int:
        """How many leading drafts the request's grammar (and a pending ban) allows."""
        constraint = request.grammar
        if constraint is None:
            return len(drafts)
        if not constraint.ready() or constraint.steer:
            return 0  # closing steers one draw at a time
        return constraint.valid_prefix(drafts)


def json_shape(spec: GrammarSpec | None, replay: list[int],
               vocab: Vocabulary | None) -> JsonShape | None:
    """The JSON limits' tracker for a JSON-kind grammar, or for the JSON values inside a
    structural tag (tool calls' arguments), after the output it resumes from."""
    if spec is None or vocab is None:
        return None
    if spec.kind in ("json", "json_object"):
        shape = JsonShape(limits_for_schema(spec.source if spec.kind == "json" else None))
    elif spec.kind == "structural_tag":
        begins = tag_json_begins(spec.source)
        if begins is None:
            return None
        limits = limits_for_schema(spec.source)
        shape = JsonShape.tagged(limits, begins) if begins else JsonShape(limits)
    else:
        return None
    shape.feed("".join(vocab.text(t) for t in replay))
    return shape


def json_closing(spec: GrammarSpec | None) -> ClosingPlan | None:
    """The closing budget's plan for a JSON-kind grammar (tool calls' structural tags and the
    other kinds have none)."""
    if spec is None or spec.kind not in ("json", "json_object"):
        return None
    return closing_plan(spec.source if spec.kind == "json" else None)
