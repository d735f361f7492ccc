"""An OpenAI-compatible HTTP endpoint over a rank's inference engine that records what it samples.

Agent code written against `openai.AsyncOpenAI` trains unchanged (as in AReaL, SkyRL, OpenRLHF and ART):
each trajectory gets a session, whose client's `base_url` points at `/sessions/{id}/v1` of this server
(the fields served: docs/agents.md). Every call samples through `engine.generate`, and the session's
`Trajectory` records the exact prompt and sampled token ids with the engine's log-probabilities.

How calls become sequences. A chat client sends the whole conversation every time, so a call's prompt
usually extends an earlier call's prompt and answer. As in the environment loop
(`RL2.rollout.loop.continuation`), a prompt that starts with a sequence's text so far continues it (only
the new text is tokenised and appended, masked), any other prompt starts a new sequence. For the text to
match, an assistant message the client sends back renders as exactly what the model sampled.

Sampling fields the engine does not implement are refused with HTTP 400 naming the field, rather
than ignored: the policy trained would not be the one the agent asked for.

Who may call. Every request carries the run's key (`OpenAIEndpoint.api_key`, random per endpoint) as
`Authorization: Bearer`, else it gets 401; session ids are random too, so no other local process can write
into a run's trajectories. Special tokens' text in the messages is tokenised as text: only the chat template
writes role tokens (`RL2.utils.tokens.render_plain`). Requests are bounded before they cost much (the
body's arrival time and JSON depth, the prompt's characters, the stop lists).
"""

import asyncio
import hmac
import itertools
import json
import math
import secrets
import socket
import time
from dataclasses import dataclass, field

from aiohttp import web

from RL2.engine.protocol import Engine, EngineError
from RL2.rollout.loop import DEFAULT_MAX_NEW_TOKENS, MAX_IDLE_RESUMES, end_text, sample_rest, sample_seed
from RL2.rollout.tools.declared import render_conversation
from RL2.rollout.tools.tool_calls import ParsedAction, ToolCallParser
from RL2.rollout.trajectory import TokenSequence, Trajectory, Turn
from RL2.utils.tokens import Spans, encode, longest_token_chars, render_plain, spans_after

# The model id `models.list()` shows; requests may name any model.
MODEL_ID = "rl2-policy"
# OpenAI's limit on choices per request; each is an engine request.
MAX_CHOICES = 128
# Request bodies carry whole conversations: well above aiohttp's 1 MiB default.
MAX_BODY_BYTES = 256 * 2**20
# Seconds a client may take to send a request's headers (from its connection, or its previous answer) and,
# again, its body: a client that trickles them (slow loris) is cut off instead of holding a connection.
READ_TIMEOUT = 30.0
# Seconds the rest of a request answered before it was read whole (401, 408) is read and dropped before its
# connection closes (aiohttp's lingering close, 10 s by default).
LINGERING_TIME = 5.0
# The deepest nesting of a request body's JSON (a tool's schema nests a few levels per property).
MAX_JSON_DEPTH = 64
# Stop strings of one request, and characters of each (OpenAI takes up to 4).
MAX_STOPS = 16
MAX_STOP_CHARS = 256

# Fields accepted at these values only (OpenAI's defaults), and why other values are refused.
_CHANGES_SAMPLING = ("would change how the policy samples, which RL2's engine does not do (the trainer "
                     "trains on what the policy samples as it is)")
_DEFAULT_ONLY = {
    "stream": ((False,), "streaming is not implemented; send stream=false"),
    "top_logprobs": ((None, 0), "the engine returns the sampled tokens' log-probabilities only; send 0"),
    "presence_penalty": ((0,), _CHANGES_SAMPLING),
    "frequency_penalty": ((0,), _CHANGES_SAMPLING),
    "logit_bias": ((None, {}), _CHANGES_SAMPLING),
    "response_format": ((None, {"type": "text"}), _CHANGES_SAMPLING + "; ask for the format in the prompt"),
    "prediction": ((None,), _CHANGES_SAMPLING),
    "reasoning_effort": ((None,), "the chat template decides how the policy reasons"),
    "functions": ((None, []), "use tools"),
    "function_call": ((None, "auto", "none"), "use tool_choice 'auto' or 'none'"),
    "modalities": ((None, ["text"]), "the policy writes text only"),
    "audio": ((None,), "the policy writes text only"),
    "web_search_options": ((None,), "the agent runs its own tools"),
}
_COMPLETION_DEFAULT_ONLY = {
    key: _DEFAULT_ONLY[key] for key in ("stream", "presence_penalty", "frequency_penalty", "logit_bias")
} | {
    "echo": ((False,), "the prompt is not sent back"),
    "suffix": ((None,), "the policy writes after the prompt only"),
    "best_of": ((None, 1), "use n"),
}
# Fields that change nothing here (bookkeeping of OpenAI's service, or streaming options).
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls",
            "safety_identifier", "prompt_cache_key"}
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
             "logprobs"}
_CHAT_FIELDS = {"messages", "tools", "tool_choice", "chat_template_kwargs"} | _SAMPLING | _IGNORED | set(_DEFAULT_ONLY)
_COMPLETION_FIELDS = {"prompt"} | _SAMPLING | _IGNORED | set(_COMPLETION_DEFAULT_ONLY)


class RequestError(Exception):
    """A request the endpoint refuses, answered in OpenAI's error shape: `message` says what is wrong and what
    to send instead, `param` names the request field at fault, `code` is OpenAI's code for it, if any; with
    `close`, the connection is closed after the answer (the rest of the request is not waited for)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.close = message, param, status, code, close

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        response = web.json_response({"error": error}, status=self.status)
        if self.close:
            response.force_close()
        return response


@dataclass
class _Tip:
    """Where one sequence of a session stands: its text so far (a call's prompt that starts with it
    continues the sequence) and the special token its last action ended with, if any."""

    sequence: TokenSequence
    text: str
    end_text: str
    turns: int


@dataclass
class _Prompt:
    """A call's prompt as token ids, and the sequence it continues (`tip`; None: a new sequence)."""

    text: str
    ids: list[int]
    tip: _Tip | None = None
    added: str = ""
    added_ids: list[int] = field(default_factory=list)


@dataclass
class _Call:
    """A request's sampling, checked."""

    params: dict  # the SGLang sampling params the request sets, over the run's defaults
    stops: list[str]  # cut from the text it gets back, as OpenAI does
    n: int  # choices, each one engine request
    logprobs: bool
    seed: int | None  # the request's own seed (else the session's, if any)
    model: str  # the model the request named, echoed back


@dataclass
class _Choice:
    """One sampled choice: its turn (as recorded) and the stop string or token that ended it."""

    turn: Turn
    matched: str | int | None


class Session:
    """One trajectory's calls; its agent's client talks to `OpenAIEndpoint.base_url_of(session)`."""

    def __init__(self, session_id: str, sampling_seed: int | None):
        self.id = session_id
        self.trajectory = Trajectory(extra_info={})  # what the calls sampled
        self.sampling_seed = sampling_seed  # call k samples with `sample_seed(sampling_seed, k)` unless it gives `seed`
        self.error: BaseException | None = None  # the engine's failure, if a call met one (the rollout raises it)
        self.closed = False
        self.calls = 0
        self.sampled_tokens = 0  # over all calls and choices, against the endpoint's max_tokens
        self.over_budget: str | None = None  # why a call was refused for the run's budget
        self._tips: list[_Tip] = []
        self._sampled: dict[str, str] = {}  # _message_key of a returned message -> the text sampled

    def prompt(self, text: str, tokenizer, plain: Spans = ()) -> _Prompt:
        """The call's prompt: continuing the sequence whose text it extends most, else a new one. `plain`: the
        spans of `text` where content wrote special tokens' text (`RL2.utils.tokens.encode`). A chat template
        re-rendering the conversation writes the end-of-turn token the action already sampled (an action's text
        skips special tokens); then the prompt must go on with exactly that token, which is not added again (as
        `RL2.rollout.loop.continuation`). A prompt that goes on otherwise does not extend the tokens sampled,
        whatever its text."""
        extended = [tip for tip in self._tips if text.startswith(tip.text + tip.end_text)]
        if not extended:
            return _Prompt(text, encode(tokenizer, text, plain))
        best = max(extended, key=lambda tip: len(tip.text))
        offset = len(best.text + best.end_text)
        added = text[offset:]
        added_ids = encode(tokenizer, added, spans_after(plain, offset))
        return _Prompt(text, best.sequence.input_ids + added_ids, best, added, added_ids)

    def record(self, prompt: _Prompt, turns: list[Turn], tokenizer) -> None:
        """Add a call's turns, one per choice: the first continues the prompt's sequence, if it still can,
        the others (and the first when another call continued that sequence meanwhile) start their own."""
        for i, turn in enumerate(turns):
            tip = prompt.tip if i == 0 else None
            if tip is not None and tip.turns == len(tip.sequence.turns):
                last = tip.sequence.turns[-1]
                last.env_text, last.env_ids = prompt.added, list(prompt.added_ids)
                tip.sequence.turns.append(turn)
            else:
                self.trajectory.start_sequence(prompt.text, prompt.ids)
                self.trajectory.add_turn(turn)
                tip = _Tip(self.trajectory.sequences[-1], "", "", 0)
                self._tips.append(tip)
            tip.text = prompt.text + turn.action_text
            tip.end_text = end_text(tokenizer, turn.action_ids)
            tip.turns = len(tip.sequence.turns)

    def remember(self, message: dict, sampled_text: str) -> None:
        """A returned assistant message renders as `sampled_text` when the client sends it back."""
        self._sampled.setdefault(_message_key(message), sampled_text)

    def as_sampled(self, messages: list[dict]) -> list[dict]:
        """The conversation with each assistant message this session returned as its sampled text."""
        out = []
        for message in messages:
            sampled = self._sampled.get(_message_key(message)) if message.get("role") == "assistant" else None
            out.append(message if sampled is None else {"role": "assistant", "content": sampled})
        return out


class OpenAIEndpoint:
    """An OpenAI-compatible HTTP server on 127.0.0.1 over one inference engine (SGLang `/generate` payloads),
    recording per session, with the policy's tokenizer.

    Args:
        parser: the tool-call format the model writes; parses the calls of requests that have tools.
        native_tools: the chat template renders tools itself (`RL2.rollout.tools.declared.render_conversation`).
        default_sampling: the run's SGLang sampling params; a request's fields override them.
        max_total_tokens: the most tokens of one sequence (None: any); a call's max_new_tokens is cut to what is left.
        stop_after_call: a request with tools stops at the format's end of a call (`rollout.tool_call_stop`).
        read_timeout: seconds a client may take to send a request's headers, and then its body.
        max_calls, max_tokens: the most model calls, and tokens sampled over them, of one session (a run of an
            agent: `rollout.agent_max_calls`, `rollout.agent_max_tokens`; None: no limit). A call past them is
            refused, and the session is over its budget (`Session.over_budget`), whatever the agent does then.
    """

    def __init__(self, engine: Engine, tokenizer, parser: ToolCallParser, native_tools: bool,
                 default_sampling: dict, max_total_tokens: int | None, stop_after_call: bool = True,
                 read_timeout: float = READ_TIMEOUT, max_calls: int | None = None, max_tokens: int | None = None):
        self.engine, self.tokenizer, self.parser = engine, tokenizer, parser
        self.native_tools, self.stop_after_call = native_tools, stop_after_call
        self.default_sampling = dict(default_sampling)
        self.max_total_tokens, self.read_timeout = max_total_tokens, read_timeout
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.api_key = secrets.token_urlsafe(32)  # every request sends it as `Authorization: Bearer`
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None

    # ---- lifecycle ----

    async def start(self) -> None:
        """Serve on a free port of 127.0.0.1, on the running event loop (once; again after `stop`)."""
        loop = asyncio.get_running_loop()
        if self._runner is not None:
            if loop is not self._loop:
                raise RuntimeError("the OpenAI endpoint serves on the event loop it was started on; "
                                   "stop() it there before starting it on another one")
            return
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_answer_request_errors, self._authorized])
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/v1/completions", self._completions)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_route("*", "/{path:.*}", self._unknown_path)
        # aiohttp (3.14) closes a connection that has not sent a whole request within keepalive_timeout of its opening
        # or previous answer, headers sent a byte at a time (slow loris) included; `_json_body` bounds the body.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=self.read_timeout,
                               lingering_time=LINGERING_TIME)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        self._runner, self._loop, self.port = runner, loop, sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop serving; every session is closed."""
        if self._runner is not None:
            await self._runner.cleanup()
        for session in self._sessions.values():
            session.closed = True
        self._sessions.clear()
        self._runner = self._loop = self.port = None

    def open_session(self, sampling_seed: int | None = None) -> Session:
        """A new session, holding an empty trajectory; with `sampling_seed`, call k samples with
        `sample_seed(sampling_seed, k)` (its choice j > 0 with `sample_seed(that, j)`) unless it gives `seed`."""
        session = Session(secrets.token_urlsafe(16), sampling_seed)
        self._sessions[session.id] = session
        return session

    def close_session(self, session: Session) -> None:
        """Forget a session: later calls get 404, and calls still in flight record nothing."""
        session.closed = True
        self._sessions.pop(session.id, None)

    def base_url_of(self, session: Session) -> str:
        """The base URL to give `openai.AsyncOpenAI(base_url=..., api_key=endpoint.api_key)` for this session."""
        if self.port is None:
            raise RuntimeError("the OpenAI endpoint is not serving; await endpoint.start() first")
        return f"http://127.0.0.1:{self.port}/sessions/{session.id}/v1"

    # ---- routes ----

    @web.middleware
    async def _authorized(self, request: web.Request, handler) -> web.StreamResponse:
        """Every request, whatever its path, must carry this endpoint's key: 401 naming what is wrong."""
        header = request.headers.get("Authorization")
        scheme, _, key = (header or "").strip().partition(" ")
        if header is None:
            problem = "the request has no Authorization header"
        elif scheme.lower() != "bearer" or not key.strip():
            problem = "the Authorization header is not 'Bearer <key>'"
        elif not hmac.compare_digest(key.strip().encode("utf-8", "surrogateescape"), self.api_key.encode()):
            problem = "the bearer key is not this run's key (each run's endpoint has a random one)"
        else:
            return await handler(request)
        raise RequestError(f"{problem}; send this run's key as 'Authorization: Bearer <key>': the api_key the "
                           f"rollout gave the agent's openai.AsyncOpenAI (OpenAIEndpoint.api_key)", status=401,
                           code="invalid_api_key")

    async def _chat(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._json_body(request)
        call = _parse_call(body, _CHAT_FIELDS, _DEFAULT_ONLY, "logprobs")
        schemas, parsing = _tools(body)
        messages = session.as_sampled(_messages(body))
        parser = self.parser if parsing else None
        template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
        try:  # special tokens' text in the agent's messages and tools tokenises as text
            text, plain = render_plain(self.tokenizer, lambda messages, schemas: render_conversation(
                self.tokenizer, messages, schemas, self.parser, self.native_tools, template_kwargs), messages, schemas)
        except Exception as e:  # the agent's messages, which the chat template may reject
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               "messages") from e
        prompt, choices, k = await self._sample(session, text, call, "messages", parser, plain)
        return web.json_response(self._chat_response(session, k, prompt, choices, call, parser))

    async def _completions(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._json_body(request)
        call = _parse_call(body, _COMPLETION_FIELDS, _COMPLETION_DEFAULT_ONLY, None)
        call.logprobs = _completion_logprobs(body.get("logprobs"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(f"prompt must be a non-empty string, not {_show(prompt)}; send one prompt "
                               f"per request", "prompt")
        prompt, choices, k = await self._sample(session, prompt, call, "prompt", None)
        return web.json_response(self._completion_response(session, k, prompt, choices, call))

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rl2"}
        return web.json_response({"object": "list", "data": [model]})

    async def _unknown_path(self, request: web.Request) -> web.Response:
        raise RequestError(f"{request.method} {request.path} is not served here; RL2's endpoint serves POST "
                           f"/sessions/<id>/v1/chat/completions, POST /sessions/<id>/v1/completions and GET "
                           f"/sessions/<id>/v1/models", status=404)

    def _session(self, request: web.Request) -> Session:
        session = self._sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(f"session {request.match_info['sid']} does not exist (it ended, or its rollout "
                               f"is over); use the base_url the rollout gave this run", status=404)
        if session.error is not None:  # the engine failed: the rollout is stopping
            raise RequestError(f"the inference engine failed: {session.error}", status=500)
        return session

    async def _json_body(self, request: web.Request) -> dict:
        """The request's JSON object; its body must arrive within `read_timeout` and nest at most MAX_JSON_DEPTH."""
        try:
            raw = await asyncio.wait_for(request.read(), self.read_timeout)
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.read_timeout} s", status=408,
                               close=True) from None
        too_deep = RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels of JSON; send a "
                                f"flatter one")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not JSON: {e}") from None
        except RecursionError:  # the parser's own limit on nesting, far past MAX_JSON_DEPTH
            raise too_deep from None
        if _deeper_than(body, MAX_JSON_DEPTH):  # the rest of the endpoint (and the template) may recurse on it
            raise too_deep
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, not {_show(body)}")
        return body

    # ---- sampling ----

    async def _sample(self, session: Session, text: str, call: _Call, prompt_field: str,
                      parser: ToolCallParser | None, plain: Spans = ()) -> tuple[_Prompt, list[_Choice], int]:
        """Sample a call's choices after `text` (`plain`: its spans of content's special-token text) and record
        them on the session's trajectory; also returns the call's number in the session. A session closed
        meanwhile (its run timed out) records nothing."""
        if self.max_total_tokens is not None:  # too long a prompt is refused untokenised (tens of MB: seconds, GBs)
            at_least = -(-len(text) // longest_token_chars(self.tokenizer))  # no token stands for more characters
            if at_least >= self.max_total_tokens:
                raise self._no_room(f"{len(text)} characters, so at least {at_least} tokens", prompt_field)
        prompt = session.prompt(text, self.tokenizer, plain)
        params = self._within_budget(session, call, self._params(call, len(prompt.ids), prompt_field, parser))
        k, session.calls = session.calls, session.calls + 1
        seed = call.seed
        if seed is None and session.sampling_seed is not None:
            seed = sample_seed(session.sampling_seed, k)
        start = time.perf_counter()
        choices = await asyncio.gather(*(
            self._generate(session, prompt.ids, params if seed is None else
                           {**params, "sampling_seed": seed if j == 0 else sample_seed(seed, j)})
            for j in range(call.n)
        ))
        session.trajectory.generate_seconds += time.perf_counter() - start
        if session.closed:
            raise RequestError(f"session {session.id} was closed while the call ran", status=404)
        session.record(prompt, [choice.turn for choice in choices], self.tokenizer)
        session.sampled_tokens += sum(len(choice.turn.action_ids) for choice in choices)
        return prompt, choices, k

    def _within_budget(self, session: Session, call: _Call, params: dict) -> dict:
        """`params` with max_new_tokens cut to what the run's token budget leaves each choice; a call past the run's
        calls or tokens is refused, and the run is over its budget."""
        over = None
        if self.max_calls is not None and session.calls >= self.max_calls:
            over = f"the agent made more than {self.max_calls} model calls (rollout.agent_max_calls)"
        elif self.max_tokens is not None:
            left = (self.max_tokens - session.sampled_tokens) // call.n
            if left < 1:
                over = (f"the agent's calls sampled {session.sampled_tokens} of its {self.max_tokens} tokens "
                        f"(rollout.agent_max_tokens), leaving none for this call")
            params["max_new_tokens"] = min(params["max_new_tokens"], left)
        if over is not None:
            session.over_budget = session.over_budget or over
            raise RequestError(f"{over}: this run may call the model no more", code="run_budget_exceeded")
        return params

    def _no_room(self, size: str, prompt_field: str) -> RequestError:
        return RequestError(f"the prompt has {size}, which leaves no room to generate within max_total_tokens="
                            f"{self.max_total_tokens} (rollout.max_total_tokens); shorten the conversation",
                            prompt_field, code="context_length_exceeded")

    def _params(self, call: _Call, prompt_len: int, prompt_field: str, parser: ToolCallParser | None) -> dict:
        """The engine's sampling params of a call: the run's, the request's over them, within the budget."""
        params = {**self.default_sampling, **call.params}
        run_temperature = self.default_sampling.get("temperature", 1.0)
        if "temperature" in call.params and call.params["temperature"] != run_temperature:
            # The trainer computes the policy's log-probabilities at the run's temperature (softmax(z / T)):
            # tokens sampled at another would be trained as if they were not.
            raise RequestError(
                f"temperature={call.params['temperature']} differs from the run's sampling temperature "
                f"{run_temperature} (rollout.train_sampling_params.temperature, or the test one), at which the "
                f"policy is trained; leave temperature out, or set the run's", "temperature")
        if parser is not None and self.stop_after_call:  # as the environment loop samples tool calls
            params = parser.stop_at_call_end(params)
        requested = params.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
        if self.max_total_tokens is not None:
            room = self.max_total_tokens - prompt_len
            if room < 1:
                raise self._no_room(f"{prompt_len} tokens", prompt_field)
            requested = min(requested, room)
        params["max_new_tokens"] = requested
        return params

    async def _generate(self, session: Session, ids: list[int], params: dict) -> _Choice:
        """One choice; an action an engine pause cut short (another client of a shared server) is
        sampled on, as `RL2.rollout.loop` resumes it, rather than returned cut."""
        turn, matched, idle = Turn([], [], "", "abort"), None, 0
        while turn.finish_reason == "abort":
            sampled = len(turn.action_ids)
            try:
                matched, _ = await sample_rest(self.engine, self.tokenizer, ids + turn.action_ids, turn, params, None)
            except Exception as e:  # the engine, not the agent, failed: the rollout must stop
                raise _engine_failed(session, e) from e
            idle = 0 if len(turn.action_ids) > sampled else idle + 1
            if turn.finish_reason == "abort" and idle == MAX_IDLE_RESUMES:
                raise _engine_failed(session, EngineError(
                    f"the engine aborted a request {idle} times in a row before it sampled a token"))
        return _Choice(turn, matched)

    # ---- responses ----

    def _chat_response(self, session: Session, k: int, prompt: _Prompt, choices: list[_Choice], call: _Call,
                       parser: ToolCallParser | None) -> dict:
        out = []
        for j, choice in enumerate(choices):
            message, parsed = assistant_message(_returned_text(choice, call.stops), parser, f"{k}_{j}")
            if parsed is not None:
                session.trajectory.tool_calls += len(message.get("tool_calls") or [])
                session.trajectory.parse_errors += len(parsed.errors)
            session.remember(message, choice.turn.action_text)
            finish = "tool_calls" if message.get("tool_calls") else _finish_reason(choice.turn)
            logprobs = {"content": self._token_logprobs(choice.turn), "refusal": None} if call.logprobs else None
            out.append({"index": j, "message": message, "finish_reason": finish, "logprobs": logprobs})
        return _response(f"chatcmpl-{session.id}-{k}", "chat.completion", call, out, prompt, choices)

    def _completion_response(self, session: Session, k: int, prompt: _Prompt, choices: list[_Choice],
                             call: _Call) -> dict:
        out = []
        for j, choice in enumerate(choices):
            logprobs = None
            if call.logprobs:
                tokens = self._token_strings(choice.turn.action_ids)
                offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=len(prompt.text)))
                logprobs = {"tokens": tokens, "token_logprobs": choice.turn.action_logps, "top_logprobs": None,
                            "text_offset": offsets if tokens else []}
            out.append({"index": j, "text": _returned_text(choice, call.stops),
                        "finish_reason": _finish_reason(choice.turn), "logprobs": logprobs})
        return _response(f"cmpl-{session.id}-{k}", "text_completion", call, out, prompt, choices)

    def _token_logprobs(self, turn: Turn) -> list[dict]:
        return [{"token": token, "logprob": logp, "bytes": list(token.encode()), "top_logprobs": []}
                for token, logp in zip(self._token_strings(turn.action_ids), turn.action_logps, strict=True)]

    def _token_strings(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[token] for token in ids])


@web.middleware
async def _answer_request_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return e.response()


def _engine_failed(session: Session, error: Exception) -> RequestError:
    """Keep the engine's failure on the session (the rollout raises it) and answer the call with 500."""
    if session.error is None:
        session.error = error
    return RequestError(f"the inference engine failed: {type(error).__name__}: {error}", status=500)


def assistant_message(text: str, parser: ToolCallParser | None,
                      call_tag: str = "0") -> tuple[dict, ParsedAction | None]:
    """The assistant message OpenAI's API returns for a sampled text (without the request's stop string),
    and the parsed action (None without a parser: the request has no tools, or tool_choice "none").
    With a parser, the text's tool calls become `tool_calls` (ids `call_{call_tag}_{i}`, unique in the
    session) and the rest `content` (None when empty). A text holding a call block that does not parse is
    all content, with no calls (as vLLM's and SGLang's parsers leave it): the agent sees what the model wrote."""
    if parser is None:
        return {"role": "assistant", "content": text}, None
    parsed = parser.parse(text)
    if parsed.errors or not parsed.calls:
        return {"role": "assistant", "content": text}, parsed
    calls = [{"id": f"call_{call_tag}_{i}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for i, c in enumerate(parsed.calls)]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, parsed


def _message_key(message: dict) -> str:
    """An assistant message as the client may send it back: content, and calls with arguments compared as JSON."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append([function.get("name"), arguments])
    return json.dumps([_text_of(message.get("content")), calls], sort_keys=True, default=str)


# ---- reading requests ----


def _deeper_than(value: object, limit: int) -> bool:
    """Whether JSON `value` nests lists and objects more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return False


# apply_chat_template's own parameters, which a request's chat_template_kwargs may not set.
_TEMPLATE_OWN = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _template_kwargs(value) -> dict:
    """A request's `chat_template_kwargs` (as vLLM and SGLang take them, e.g. {"enable_thinking": false}):
    variables of the chat template, checked."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise RequestError(f"chat_template_kwargs must be an object of the template's variables, not {_show(value)}",
                           "chat_template_kwargs")
    if own := sorted(_TEMPLATE_OWN & set(value)):
        raise RequestError(f"chat_template_kwargs sets {', '.join(own)}, which the endpoint sets itself; pass only "
                           f"the template's own variables (e.g. enable_thinking)", "chat_template_kwargs")
    return value


def _parse_call(body: dict, known: set[str], default_only: dict, logprobs_field: str | None) -> _Call:
    """A request's sampling fields, checked; unknown fields and unsupported values are refused."""
    for key in body:
        if key not in known:
            raise RequestError(f"unknown field {key!r}; RL2's endpoint takes {', '.join(sorted(known))}", key)
    for key, (accepted, why) in default_only.items():
        value = body.get(key)
        if value is not None and value not in accepted:
            raise RequestError(f"{key}={_show(value)} is not supported: {why}; or leave {key} out", key)
    bounds = {"temperature": (0.0, None, False), "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, False),
              "top_k": (-1, None, True)}  # low, high, integer
    params = {key: value for key, bound in bounds.items() if (value := _number(body, key, *bound)) is not None}
    if params.get("top_p") == 0:
        raise RequestError("top_p=0 keeps no token; give a value in (0, 1]", "top_p")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if (max_tokens := _number(body, key, 1, None, True)) is not None:
        params["max_new_tokens"] = max_tokens
    stops = _stops(body.get("stop"))
    if body.get("stop") is not None:
        params["stop"] = stops
    n = _number(body, "n", 1, MAX_CHOICES, True)
    seed = _number(body, "seed", None, None, True)
    logprobs = body.get(logprobs_field) if logprobs_field else None
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"logprobs must be true or false, not {_show(logprobs)}", "logprobs")
    model = body.get("model")
    model = model if isinstance(model, str) else MODEL_ID
    return _Call(params, stops, 1 if n is None else n, bool(logprobs), seed, model)


def _number(body: dict, key: str, low: float | None, high: float | None, integer: bool) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise RequestError(f"{key}={_show(value)} is not {'an integer' if integer else 'a number'}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{key}={value} must be {bounds}", key)
    return value


def _stops(stop: object) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, not {_show(stop)}", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop has {len(stops)} strings; send at most {MAX_STOPS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop has a string of {max(map(len, stops))} characters; each may have at most "
                           f"{MAX_STOP_CHARS}", "stop")
    return stops


def _completion_logprobs(value: object) -> bool:
    """/v1/completions' `logprobs` is the number of alternatives per token: 0 returns the sampled
    tokens' log-probabilities, alternatives are not computed."""
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int) or value != 0:
        raise RequestError(f"logprobs={_show(value)} is not supported: the engine returns the sampled tokens' "
                           f"log-probabilities only; send logprobs=0 (or leave it out)", "logprobs")
    return True


def _tools(body: dict) -> tuple[list[dict] | None, bool]:
    """The request's tool schemas (None without tools), and whether to parse calls out of the answer."""
    tools, choice = body.get("tools") or None, body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError('tools must be a list of {"type": "function", "function": {"name": ..., '
                               '"parameters": ...}}', "tools")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice={_show(choice)} is not supported: the policy is sampled as it is, and "
                           f"nothing forces it to call a tool; send 'auto' (or 'none') and check its answer",
                           "tool_choice")
    return tools, tools is not None and choice != "none"


def _messages(body: dict) -> list[dict]:
    """The request's messages, each content as one string (the chat template's input)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, not {_show(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user",
                                                                          "assistant", "tool"):
            raise RequestError(f"messages[{i}] must be an object with role system, developer, user, assistant "
                               f"or tool, not {_show(message)}", f"messages[{i}]")
        message = {key: value for key, value in message.items() if value is not None}
        if message["role"] == "developer":  # OpenAI's newer name for system
            message["role"] = "system"
        if "content" in message:
            try:
                message["content"] = _text_of(message["content"])
            except ValueError as e:
                raise RequestError(f"messages[{i}].content: {e}", f"messages[{i}].content") from None
        out.append(message)
    return out


def _text_of(content: object) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise ValueError(f"{_show(content)} is neither a string nor a list of text parts; the policy reads text only")


def _returned_text(choice: _Choice, stops: list[str]) -> str:
    """The text the client gets: without the request's stop string that ended it, as OpenAI returns it
    (the sampled text, and the tokens trained, keep it)."""
    text = choice.turn.action_text
    if isinstance(choice.matched, str) and choice.matched in stops and text.endswith(choice.matched):
        return text[: -len(choice.matched)]
    return text


def _finish_reason(turn: Turn) -> str:
    return "length" if turn.finish_reason == "length" else "stop"


def _response(response_id: str, kind: str, call: _Call, out: list[dict], prompt: _Prompt,
              choices: list[_Choice]) -> dict:
    """A response of OpenAI's shape, with its token usage."""
    completion = sum(len(choice.turn.action_ids) for choice in choices)
    usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": completion,
             "total_tokens": len(prompt.ids) + completion}
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": call.model, "choices": out,
            "usage": usage}


def _show(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
