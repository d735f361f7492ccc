"""An HTTP endpoint over a rank's inference engine that serves the APIs agent code is written against (OpenAI's chat
completions, completions and responses, Anthropic's messages) and records what it samples, per session, as a
trajectory (`RL2.agents.sessions`). Each API's module turns its request into chat messages and tools, which take one
path here (`OpenAIEndpoint.chat_turn`). Who may call, and the bounds on requests: docs/agents.md."""

import asyncio
import functools
import hmac
import json
import secrets
import socket
import time
from dataclasses import dataclass

from aiohttp import web

from RL2.agents import chat_api, messages_api, responses_api
from RL2.agents.requests import Call, RequestError, deeper_than, show
from RL2.agents.sessions import Prompt, Session
from RL2.agents.streaming import send_events
from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.engine.protocol import Engine, EngineError
from RL2.rollout.loop import DEFAULT_MAX_NEW_TOKENS, MAX_IDLE_RESUMES, sample_rest, sample_seed
from RL2.rollout.tools.declared import render_conversation
from RL2.rollout.tools.tool_calls import ParsedAction, ToolCallParser
from RL2.rollout.trajectory import Turn
from RL2.utils.tokens import Spans, longest_token_chars, render_plain

# Request bodies carry whole conversations: well above aiohttp's 1 MiB default.
MAX_BODY_BYTES = 256 * 2**20
# Seconds a client may take to send a request's headers (from its connection, or its previous answer) and,
# again, its body: a client that trickles them (slow loris) is cut off instead of holding a connection.
READ_TIMEOUT = 30.0
# Seconds the rest of a request answered before it was read whole (401, 408) is read and dropped before its
# connection closes (aiohttp's lingering close, 10 s by default).
LINGERING_TIME = 5.0
# Seconds without a new call the embedded engine waits for before a batch's first step
# (`EmbeddedEngine.arrival_quiet`): a batch of agents' calls arrives over milliseconds (see bench_agent_endpoint.py).
ARRIVAL_QUIET = 0.005
# The deepest nesting of a request body's JSON (a tool's schema nests a few levels per property).
MAX_JSON_DEPTH = 64
# The routes under /sessions/{sid}: (method, path, handler(endpoint, session, body) -> JSON, or stream events).
ROUTES = [("POST", "/v1/chat/completions", chat_api.chat_completions),
          ("POST", "/v1/completions", chat_api.completions), ("POST", "/v1/responses", responses_api.responses),
          ("POST", "/v1/messages", messages_api.messages), ("GET", "/v1/models", chat_api.models)]


@dataclass
class Reply:
    """One sampled choice of a call: its turn (as recorded), the stop string or token that ended it, the text
    the client gets (without the request's stop string), and for a chat-shaped call the assistant's message."""

    turn: Turn
    matched: str | int | None
    text: str = ""
    message: dict | None = None

    @property
    def finish(self) -> str:
        """OpenAI's finish reason."""
        if self.message is not None and self.message.get("tool_calls"):
            return "tool_calls"
        return "length" if self.turn.finish_reason == "length" else "stop"


@dataclass
class Answer:
    """A call's answer: its prompt, its choices, and its number in the session (`k`)."""

    prompt: Prompt
    replies: list[Reply]
    k: int

    @property
    def completion_tokens(self) -> int:
        return sum(len(reply.turn.action_ids) for reply in self.replies)


class OpenAIEndpoint:
    """The HTTP server on 127.0.0.1 over one inference engine (SGLang `/generate` payloads) and the policy's tokenizer.

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
        if isinstance(engine, EmbeddedEngine):  # calls sent together arrive apart over HTTP; let them share a prefill
            engine.arrival_quiet = ARRIVAL_QUIET

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
        for method, path, handler in ROUTES:
            app.router.add_route(method, "/sessions/{sid}" + path, functools.partial(self._serve, handler))
        app.router.add_route("*", "/{path:.*}", self._unknown_path)
        # aiohttp (3.14) bounds a request's headers by keepalive_timeout (READ_TIMEOUT); `json_body` bounds its body.
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
        """The base URL to give `openai.AsyncOpenAI(base_url=..., api_key=endpoint.api_key)` for this session
        (without its `/v1`, `anthropic.AsyncAnthropic`'s)."""
        if self.port is None:
            raise RuntimeError("the OpenAI endpoint is not serving; await endpoint.start() first")
        return f"http://127.0.0.1:{self.port}/sessions/{session.id}/v1"

    # ---- requests ----

    @web.middleware
    async def _authorized(self, request: web.Request, handler) -> web.StreamResponse:
        """Every request, whatever its path, must carry this endpoint's key: 401 naming what is wrong."""
        header = request.headers.get("Authorization")
        if header is None and (key := request.headers.get("x-api-key")) is not None:  # Anthropic's client
            header = f"Bearer {key}"
        scheme, _, key = (header or "").strip().partition(" ")
        if header is None:
            problem = "the request has no Authorization header"
        elif scheme.lower() != "bearer" or not key.strip():
            problem = "the Authorization header is not 'Bearer <key>'"
        elif not hmac.compare_digest(key.strip().encode("utf-8", "surrogateescape"), self.api_key.encode()):
            problem = "the bearer key is not this run's key (each run's endpoint has a random one)"
        else:
            return await handler(request)
        raise RequestError(f"{problem}; send this run's key as 'Authorization: Bearer <key>' (or 'x-api-key: <key>'): "
                           f"the api_key the rollout gave the agent's openai.AsyncOpenAI (OpenAIEndpoint.api_key)",
                           status=401, code="invalid_api_key")

    async def _serve(self, handler, request: web.Request) -> web.StreamResponse:
        """Answer a request of a live session with what its API's `handler` makes of the session and the JSON body:
        a JSON object, or a list of server-sent events (`RL2.agents.streaming.send_events`)."""
        session = self._sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(f"session {request.match_info['sid']} does not exist (it ended, or its rollout "
                               f"is over); use the base_url the rollout gave this run", status=404)
        if session.error is not None:  # the engine failed: the rollout is stopping
            raise RequestError(f"the inference engine failed: {session.error}", status=500)
        body = await self.json_body(request) if request.method == "POST" else {}
        answer = await handler(self, session, body)
        return await send_events(request, answer) if isinstance(answer, list) else web.json_response(answer)

    async def _unknown_path(self, request: web.Request) -> web.Response:
        served = ", ".join(f"{method} /sessions/<id>{path}" for method, path, _ in ROUTES)
        raise RequestError(f"{request.method} {request.path} is not served here; RL2's endpoint serves {served}",
                           status=404)

    async def json_body(self, request: web.Request) -> dict:
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
        if deeper_than(body, MAX_JSON_DEPTH):  # the rest of the endpoint (and the template) may recurse on it
            raise too_deep
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, not {show(body)}")
        return body

    # ---- sampling ----

    async def chat_turn(self, session: Session, messages: list[dict], schemas: list[dict] | None, parsing: bool,
                        call: Call, field: str = "messages") -> Answer:
        """Sample a call of chat `messages` (OpenAI's shape, content as text) with tool `schemas`, rendered by the
        chat template, and record it; with `parsing`, each answer's tool calls are parsed by the run's format.
        `field`: the request's field of the messages (named in errors)."""
        parser = self.parser if parsing else None
        try:  # special tokens' text in the agent's messages and tools tokenises as text
            text, plain = render_plain(self.tokenizer, lambda messages, schemas: render_conversation(
                self.tokenizer, messages, schemas, self.parser, self.native_tools, call.template_kwargs),
                session.as_sampled(messages), schemas)
        except Exception as e:  # the agent's messages, which the chat template may reject
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               field) from e
        answer = await self.sample(session, text, call, field, parser, plain)
        for j, reply in enumerate(answer.replies):
            reply.message, parsed = assistant_message(reply.text, parser, f"{answer.k}_{j}")
            if parsed is not None:
                session.trajectory.tool_calls += len(reply.message.get("tool_calls") or [])
                session.trajectory.parse_errors += len(parsed.errors)
            session.remember(reply.message, reply.turn.action_text)
        return answer

    async def sample(self, session: Session, text: str, call: Call, prompt_field: str,
                     parser: ToolCallParser | None, plain: Spans = ()) -> Answer:
        """Sample a call's choices after `text` (`plain`: its spans of content's special-token text) and record
        them on the session's trajectory. A session closed meanwhile (its run timed out) records nothing."""
        if self.max_total_tokens is not None:  # too long a prompt is refused untokenised (tens of MB: seconds, GBs)
            at_least = -(-len(text) // longest_token_chars(self.tokenizer))  # no token stands for more characters
            if at_least >= self.max_total_tokens:
                raise self._no_room(f"{len(text)} characters, so at least {at_least} tokens", prompt_field)
        prompt = session.prompt(text, self.tokenizer, plain)
        params = self._params(session, call, len(prompt.ids), prompt_field, parser)
        k, session.calls = session.calls, session.calls + 1
        seed = call.seed
        if seed is None and session.sampling_seed is not None:
            seed = sample_seed(session.sampling_seed, k)
        start = time.perf_counter()
        replies = await asyncio.gather(*(
            self._generate(session, prompt.ids, params if seed is None else
                           {**params, "sampling_seed": seed if j == 0 else sample_seed(seed, j)})
            for j in range(call.n)
        ))
        session.trajectory.generate_seconds += time.perf_counter() - start
        if session.closed:
            raise RequestError(f"session {session.id} was closed while the call ran", status=404)
        session.record(prompt, [reply.turn for reply in replies], self.tokenizer)
        session.sampled_tokens += sum(len(reply.turn.action_ids) for reply in replies)
        calls = session.trajectory.agent_calls
        calls[call.api] += 1
        calls["streamed"] += call.stream
        for reply in replies:  # the client gets the text without the request's stop string, as OpenAI returns it
            text, matched = reply.turn.action_text, reply.matched
            stopped = isinstance(matched, str) and matched in call.stops and text.endswith(matched)
            reply.text = text[: -len(matched)] if stopped else text
        return Answer(prompt, list(replies), k)

    def _no_room(self, size: str, prompt_field: str) -> RequestError:
        return RequestError(f"the prompt has {size}, which leaves no room to generate within max_total_tokens="
                            f"{self.max_total_tokens} (rollout.max_total_tokens); shorten the conversation",
                            prompt_field, code="context_length_exceeded")

    def _params(self, session: Session, call: Call, prompt_len: int, prompt_field: str,
                parser: ToolCallParser | None) -> dict:
        """The engine's sampling params of a call: the run's, the request's over them, max_new_tokens cut to the
        sequence's room and to what the run's token budget leaves each choice. A call past the run's calls or
        tokens is refused, and the run is over its budget."""
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
        over = None
        if self.max_calls is not None and session.calls >= self.max_calls:
            over = f"the agent made more than {self.max_calls} model calls (rollout.agent_max_calls)"
        elif self.max_tokens is not None:
            left = (self.max_tokens - session.sampled_tokens) // call.n
            if left < 1:
                over = (f"the agent's calls sampled {session.sampled_tokens} of its {self.max_tokens} tokens "
                        f"(rollout.agent_max_tokens), leaving none for this call")
            requested = min(requested, left)
        if over is not None:
            session.over_budget = session.over_budget or over
            raise RequestError(f"{over}: this run may call the model no more", code="run_budget_exceeded")
        params["max_new_tokens"] = requested
        return params

    async def _generate(self, session: Session, ids: list[int], params: dict) -> Reply:
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
        return Reply(turn, matched)

    def token_strings(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[token] for token in ids])


@web.middleware
async def _answer_request_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return e.response(anthropic=request.path.endswith("/v1/messages"))


def _engine_failed(session: Session, error: Exception) -> RequestError:
    """Keep the engine's failure on the session (the rollout raises it) and answer the call with 500."""
    if session.error is None:
        session.error = error
    return RequestError(f"the inference engine failed: {type(error).__name__}: {error}", status=500)


def assistant_message(text: str, parser: ToolCallParser | None,
                      call_tag: str = "0") -> tuple[dict, ParsedAction | None]:
    """The assistant message OpenAI's chat API returns for a sampled text (without the request's stop string), and
    the parsed action (None without a parser: the request has no tools, or tool_choice "none"). With a parser, the
    text's tool calls become `tool_calls` (ids `call_{call_tag}_{i}`, unique in the session) and the rest `content`
    (None when empty); a text holding a call block that does not parse is all content (as vLLM's and SGLang's
    parsers leave it): the agent sees what the model wrote."""
    if parser is None:
        return {"role": "assistant", "content": text}, None
    parsed = parser.parse(text)
    if parsed.errors or not parsed.calls:
        return {"role": "assistant", "content": text}, parsed
    calls = [{"id": f"call_{call_tag}_{i}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for i, c in enumerate(parsed.calls)]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, parsed
