"""OpenAI Batch API request files as job inputs, OpenAI batch output files as results.

A request line is `{"custom_id", "method": "POST", "url", "body"}` with url
`/v1/chat/completions` (body.messages, through the chat template) or `/v1/completions`
(body.prompt: text or token ids). A message's content is its text, or a list of text
parts (`[{"type": "text", "text": ...}]`) joined with newlines as vLLM's OpenAI server
joins them; a part of another type (an image, audio, a file) fails its line
(`unsupported_content`). Body fields map onto SamplingParams (BODY_FIELDS); a
field missing from the body takes the job's value (its flags), the seed being the row's
own as in any job. `body.model` is ignored: every request runs on the job's --model (the
scan warns once, naming the models the file asks for). Any other field fails its line.

Each request gives one line: a response (status 200, a chat.completion or
text_completion body with one choice per completion and `usage`) in the part's output
file, or `{"error": {"code", "message"}}` naming the custom_id (or the line) in its
errors file. A part's stats count its lines like a Parquet part's rows: errors, lines
cut at their length limit and lines whose structured output is invalid (a line with
several choices counts once). A line that is no request is an error line, never a failed job: not JSON,
not UTF-8 (bad bytes are not read as U+FFFD), a field nested past MAX_DEPTH levels, a
lone surrogate in a string (`"\ud800"`: no UTF-8 file can hold it), a conversation too
large for the context (sized before the chat template renders it). A custom_id that two
or more lines of the job's files share is an error on each of them (`duplicate_custom_id`,
naming the others, in another file by its path): results are matched to requests by
custom_id, one `output.jsonl` holds every file's, and OpenAI's Batch API refuses such a
file, so none of them is served. Planning finds both (`jobs/batch_checks.py`). Parts
commit like any JSONL part (`Output.commit_files`); the job's end merges them into
`output.jsonl` and `errors.jsonl`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass

from fusegen.engine.sampling_params import FIELDS, SamplingParams
from fusegen.engine.tokenizer import PromptError, PromptLimit
from fusegen.jobs import errors
from fusegen.jobs.batch_checks import LineChecks, leading_custom_id
from fusegen.jobs.output import PARTS_DIR, Output, PartStats, jsonl_bytes
from fusegen.jobs.params import (ParamError, TooDeep, coerce, lone_surrogate, nesting_problem,
                                 read_json)
from fusegen.jobs.redact import redact_url
from fusegen.jobs.rows import conversation, row_seed

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# body field -> SamplingParams field, from each field's `body` names (OpenAI's, and the
# ones vLLM's OpenAI server takes besides: top_k, min_p, repetition_penalty, ...).
BODY_FIELDS = {key: f.name for f in FIELDS for key in f.metadata["body"]}
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")  # at most one per request
# Fields that do not change what is generated; ignored.
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options"})
# Fields that are fine at these values only.
NEUTRAL = {"stream": (False, None), "echo": (False, None), "suffix": (None,),
           "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"),
           "parallel_tool_calls": (None, True, False),
           # vLLM's: it changes the decode of slow tokenizers only, never fusegen's
           "spaces_between_special_tokens": (None, True, False)}
INVALID_REQUEST, UNSUPPORTED = "invalid_request", "unsupported_field"
UNSUPPORTED_CONTENT = "unsupported_content"  # a message part that is not text
DUPLICATE = "duplicate_custom_id"  # OpenAI's code for it


@dataclass(slots=True)
class BatchRequest:
    line: int
    custom_id: str | None = None
    url: str = CHAT
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    top_logprobs: int | None = None  # asked for logprobs: the top-k to show
    error: dict | None = None  # {"code", "message"}: the line is not submitted


# A request line nested past this many levels is refused whole, before it is parsed: below
# what every supported Python's parser reads (3.11's recursion ends near 1,000 levels, 3.12
# reads deeper), so a line gets the same error on each; shallower lines are parsed and each
# field nested past MAX_DEPTH is named.
LINE_DEPTH = 800

def parse_request(text: str, line: int, base: SamplingParams, index: int, chat=None,
                  system_prompt: str | None = None,
                  limit: PromptLimit | None = None) -> BatchRequest:
    """A request line as a prompt and its SamplingParams, or an error naming the custom_id
    (or the line) and the field. `index`: the row's global position (its seed);
    `chat`: messages -> prompt (the chat template), given the conversation with
    `system_prompt` first, once it is known to fit `limit` (the engine's)."""
    req = BatchRequest(line)
    try:
        obj = read_json(text, max_depth=LINE_DEPTH)  # each field's depth is checked below
    except ValueError as exc:
        req.custom_id = leading_custom_id(text)
        return _fail(req, INVALID_REQUEST, str(TooDeep()) if isinstance(exc, TooDeep) else
                     f"is not JSON ({exc})")
    if not isinstance(obj, dict):
        return _fail(req, INVALID_REQUEST, "is not a JSON object")
    if isinstance(obj.get("custom_id"), str):
        req.custom_id = obj["custom_id"]
    problem = _value_problem(obj) or _envelope_problem(obj)
    if problem:
        return _fail(req, INVALID_REQUEST, problem)
    req.url, body = obj["url"], obj["body"]
    try:
        req.prompt = _prompt(req.url, body, chat, system_prompt, limit)
        req.params, req.top_logprobs = _params(req.url, body, base, index)
    except _LineError as exc:
        return _fail(req, exc.code, str(exc))
    return req


class _LineError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _fail(req: BatchRequest, code: str, message: str) -> BatchRequest:
    req.error = {"code": code, "message": f"{_where(req)}: {message}"}
    return req


def _where(req: BatchRequest) -> str:
    return f"line {req.line}" + (f" (custom_id {req.custom_id!r})" if req.custom_id else "")


def _value_problem(obj: dict) -> str | None:
    """A field the request uses (custom_id, method, url, the body's but the ignored ones)
    nested past MAX_DEPTH, or a lone surrogate in one of its strings: found before
    anything reads them recursively (an error message showing a value, the chat
    template) or writes them (the custom_id, in the line's result)."""
    used = {k: obj[k] for k in ("custom_id", "method", "url") if k in obj}
    body = obj.get("body")
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in IGNORED}
    fields = [*used.items(), *((f"body.{k}", v) for k, v in body.items())] \
        if isinstance(body, dict) else [*used.items(), ("body", body)]
    deep = next((f"{name} {problem}" for name, value in fields
                 if (problem := nesting_problem(value))), None)
    bad = deep is None and lone_surrogate({**used, "body": body})
    if bad:
        where, char, at = bad
        return (f"{where.lstrip('.')} holds a lone surrogate U+{ord(char):04X} at character "
                f"{at}, which is not valid Unicode (UTF-8 cannot hold it); remove it")
    return deep


def _envelope_problem(obj: dict) -> str | None:
    if not isinstance(obj.get("custom_id"), str):
        return "has no string custom_id; give every request a unique custom_id"
    if obj.get("method", "POST") != "POST":
        return f"method must be POST, got {obj.get('method')!r}"
    if obj.get("url") not in (CHAT, COMPLETIONS):
        return f"url must be {CHAT} or {COMPLETIONS}, got {obj.get('url')!r}"
    if not isinstance(obj.get("body"), dict):
        return "has no body object"
    return None


def _prompt(url: str, body: dict, chat, system_prompt: str | None, limit: PromptLimit | None):
    if url == CHAT:
        messages, problem = conversation(_text_content(body.get("messages")), "body.messages",
                                         system_prompt, limit)
        if problem:
            code, message = problem
            raise _LineError(INVALID_REQUEST if code == errors.INVALID_PROMPT else code, message)
        try:
            return chat(messages)
        except PromptError as exc:  # past the prompt limit, or the tokenizer failed on it
            code = INVALID_REQUEST if exc.code == errors.INVALID_PROMPT else exc.code
            raise _LineError(code, f"body.messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the template's refusal is this line's
            raise _LineError(INVALID_REQUEST, f"body.messages: the chat template failed: "
                             f"{type(exc).__name__}: {exc}") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise _LineError(INVALID_REQUEST, "body.prompt must be a non-empty string or a list "
                         "of token ids (one prompt per request line)")
    return prompt


def _text_content(messages):
    """`messages` with each content given as a list of parts (OpenAI's form) as its text,
    the text parts joined with newlines; any other shape is left for `conversation` to
    name. A part that is not text fails the line."""
    if not isinstance(messages, list):
        return messages
    joined = []
    for i, message in enumerate(messages):
        parts = message.get("content") if isinstance(message, dict) else None
        if isinstance(parts, list):
            message = {**message, "content": "\n".join(
                _part_text(part, f"body.messages[{i}].content[{j}]")
                for j, part in enumerate(parts))}
        joined.append(message)
    return joined


def _part_text(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind != "text":
        raise _LineError(UNSUPPORTED_CONTENT, f"{where} is a {_show(kind)} part; fusegen "
                         "runs text models: send text parts ({\"type\": \"text\", "
                         "\"text\": ...}) or the content as a string")
    raise _LineError(INVALID_REQUEST, f"{where} must be a part such as {{\"type\": "
                     f"\"text\", \"text\": \"...\"}}, got {_show(part)}")


def _params(url: str, body: dict, base: SamplingParams, index: int):
    """(SamplingParams, top logprobs to show or None)."""
    seed = None if base.seed is None else row_seed(base.seed, index)
    changes = {"seed": seed}
    constraints = [k for k, v in body.items() if BODY_FIELDS.get(k) in CONSTRAINTS
                   and v is not None]
    if len(constraints) > 1:
        raise _LineError(INVALID_REQUEST, f"body.{constraints[0]} and body.{constraints[1]} "
                         "both constrain the output; give one")
    if constraints:  # the line's constraint replaces the job's
        changes.update(dict.fromkeys(CONSTRAINTS))
    logprobs = _logprobs(url, body)
    if logprobs is not None:
        changes["logprobs"] = logprobs
    both = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(both) == 2 and body[both[0]] != body[both[1]]:
        raise _LineError(INVALID_REQUEST, "body.max_tokens and body.max_completion_tokens "
                         "differ; give one")
    for key, value in body.items():
        if key in ("messages", "prompt", "logprobs", "top_logprobs") or key in IGNORED \
                or value is None:
            continue
        if key in NEUTRAL:
            if value not in NEUTRAL[key]:
                raise _LineError(UNSUPPORTED, f"body.{key}={_show(value)} is not supported "
                                 "by fusegen's batch runner; drop it")
            continue
        field = BODY_FIELDS.get(key)
        if field is None:
            raise _LineError(UNSUPPORTED, f"body.{key} is not a field fusegen supports; "
                             f"drop it (supported: {', '.join(BODY_FIELDS)})")
        changes[field] = _value(key, field, value)
    params = dataclasses.replace(base, **changes)
    problem = params.validate()
    if problem:
        raise _LineError(INVALID_REQUEST, f"body: {problem}")
    return params, logprobs


def _logprobs(url: str, body: dict) -> int | None:
    """Chat: logprobs true (+ top_logprobs k) -> k (0: only the chosen token);
    completions: logprobs k -> k."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if url == COMPLETIONS:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise _LineError(INVALID_REQUEST, f"body.logprobs must be an integer for "
                             f"{COMPLETIONS}, got {_show(value)}")
        return value
    if value not in (None, True, False):
        raise _LineError(INVALID_REQUEST, f"body.logprobs must be true or false, got "
                         f"{_show(value)}")
    if top is not None and not value:
        raise _LineError(INVALID_REQUEST, "body.top_logprobs needs body.logprobs true")
    return (top or 0) if value else None


def _value(key: str, field: str, value):
    name = "response_format" if key == "response_format" else field
    try:
        return coerce(name, value)
    except ParamError as exc:
        raise _LineError(INVALID_REQUEST, f"body.{key} {exc}") from None


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:80] + "..."


def run_batch_partition(spec, part, llm, table, fingerprint: str, owner, wait,
                        started: float) -> PartStats:
    """Generate every request of a partition read from a batch file (`line`, `request`
    columns) and commit its output and errors files. `wait(futures, num_rejected)`: the
    futures' results, reporting progress meanwhile."""
    base, limit = spec.sampling_params(), llm.prompt_limit
    chat = _chat_fn(llm, spec)
    checks = part.text.checks  # the plan's, for this partition's lines
    lines = table.column("line").to_pylist()
    requests = [_check_line(parse_request(text, line, base, part.first_row + i, chat,
                                          spec.system_prompt, limit), checks, part.path)
                for i, (line, text) in enumerate(zip(lines, table.column("request").to_pylist()))]
    valid = [r for r in requests if r.error is None]
    outputs = iter(wait(llm.submit_many([(r.prompt, r.params) for r in valid]),
                        len(requests) - len(valid)))
    model, created = _model_name(spec.model), int(time.time())
    done, failed = [], []
    stats = PartStats(part.name, fingerprint, num_rows=len(requests), num_truncated=0,
                      num_structured_invalid=0)
    for req in requests:
        out = None if req.error else next(outputs)
        if out is not None and out.error is None and out.finish_reason != "error":
            done.append(response_line(req, out, model, created, _token_text(llm), fingerprint,
                                      spec.output_token_ids))
            _count_response(stats, out)
            continue
        error = req.error or _engine_error(req, out)
        failed.append({"id": _id("batch_req_", fingerprint, req.line), "custom_id": req.custom_id,
                       "response": None, "error": error})
        stats.num_errors += 1
        stats.errors_by_code[error["code"]] = stats.errors_by_code.get(error["code"], 0) + 1
    stats.seconds = round(time.perf_counter() - started, 3)
    stem = part.name.removesuffix(".jsonl")
    Output(spec.output, spec.storage_options, owner=owner).commit_files(stats, {
        f"{PARTS_DIR}/{stem}.jsonl": _jsonl(done),
        f"{PARTS_DIR}/{stem}.errors.jsonl": _jsonl(failed)})
    return stats


def _count_response(stats: PartStats, out) -> None:
    """Add one served line to its part's counts. A row here is a request line, as in
    `num_rows`: a line is cut at its length limit (finish_reason "length") when any of
    its choices is, and its structured output invalid when any choice's is."""
    stats.num_prompt_tokens += out.num_prompt_tokens
    stats.num_generated_tokens += out.num_generated_tokens
    stats.num_truncated += any(c.finish_reason == "length" for c in out.outputs)
    stats.num_structured_invalid += any(c.structured_valid is False for c in out.outputs)


def _check_line(req: BatchRequest, checks: LineChecks | None, path: str) -> BatchRequest:
    """`req` made its line's error line when planning found the line not UTF-8, or other
    lines of the job's files holding its custom_id (all of them fail: OpenAI refuses such
    a file, and one output.jsonl holds the results of every file)."""
    problem = checks and checks.not_utf8(req.line)
    if problem:
        if req.custom_id is not None and "\ufffd" in req.custom_id:
            req.custom_id = None  # its own bytes are the bad ones: not shown
        return _fail(req, INVALID_REQUEST, problem)
    others = checks and req.error is None and checks.shared_with(path, req.line)
    if not others:
        return req
    return _fail(req, DUPLICATE, f"the custom_id is also on {others}; a result is matched to "
                 "its request by custom_id, so none of them is served: give each request "
                 "its own")


def _jsonl(lines: list[dict]) -> bytes:
    """`jsonl_bytes`; a line holding a lone surrogate (an error line's custom_id as the
    request wrote it, `"\ud800"`) is written with JSON's escapes: the same value, in
    UTF-8 a reader can decode."""
    try:
        return jsonl_bytes(lines)
    except UnicodeEncodeError:
        return b"".join(json.dumps(line, default=str).encode() + b"\n" for line in lines)


def _model_name(model: str) -> str:
    """The response's `model`: a local checkpoint by its file or folder name."""
    model = redact_url(model)
    return os.path.basename(model.rstrip("/")) if os.path.isabs(model) else model


def _chat_fn(llm, spec):
    def chat(messages):  # --system-prompt is in them already (`conversation`)
        return llm.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                         chat_template=spec.chat_template)
    return chat


def _engine_error(req: BatchRequest, out) -> dict:
    code, _, message = (out.error or "engine_error: no message").partition(": ")
    return {"code": code, "message": f"{_where(req)}: {message}"}


def _id(prefix: str, fingerprint: str, line: int) -> str:
    """Stable across reruns: a resumed job writes the same ids. `prefix` ends with its
    separator, as OpenAI's ids do (batch_req_..., chatcmpl-...)."""
    return prefix + hashlib.sha256(f"{fingerprint}:{line}".encode()).hexdigest()[:24]


def response_line(req: BatchRequest, out, model: str, created: int, text_of,
                  fingerprint: str, token_ids: bool = False) -> dict:
    """One request's line of OpenAI's batch output format; `token_ids`
    (--output-token-ids): each choice also carries its generated ids (as vLLM's
    `return_token_ids` does)."""
    chat = req.url == CHAT
    choices = []
    for c in out.outputs:
        choice = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice["logprobs"] = None if req.top_logprobs is None else \
            (chat_logprobs if chat else completion_logprobs)(
                c.token_ids, c.logprobs or [], req.top_logprobs, text_of)
        choice["finish_reason"] = c.finish_reason
        if token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    generated = out.num_generated_tokens
    body = {"id": _id("chatcmpl-" if chat else "cmpl-", fingerprint, req.line),
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": generated,
                      "total_tokens": out.num_prompt_tokens + generated,
                      # the prompt tokens whose KV blocks came from the prefix cache
                      "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}}
    return {"id": _id("batch_req_", fingerprint, req.line), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _id("req_", fingerprint, req.line),
                         "body": body}, "error": None}


def _token_text(llm):
    return lambda token_id, lp: lp.decoded_token if getattr(lp, "decoded_token", None) \
        is not None else llm.tokenizer.decode([token_id])


def _top(position: dict, k: int) -> list:
    """The position's top-k entries (token id, Logprob), best first."""
    ranked = sorted((e for e in position.items() if e[1].rank is not None), key=lambda e: e[1].rank)
    return [e for e in ranked if e[1].rank <= k][:k]


def chat_logprobs(token_ids, positions, k: int, text_of) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id, lp):
        token = text_of(token_id, lp)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}
    content = []
    for token_id, position in zip(token_ids, positions):
        content.append({**entry(token_id, position[token_id]),
                        "top_logprobs": [entry(t, lp) for t, lp in _top(position, k)]})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids, positions, k: int, text_of) -> dict:
    """OpenAI's completions shape: parallel lists of tokens, their logprobs, the top-k as
    {token: logprob} and each token's character offset in the text."""
    tokens, offset, offsets = [], 0, []
    for token_id, position in zip(token_ids, positions):
        tokens.append(text_of(token_id, position[token_id]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [p[t].logprob for t, p in zip(token_ids, positions)],
            "top_logprobs": [{text_of(t, lp): lp.logprob for t, lp in _top(p, k)}
                             for p in positions],
            "text_offset": offsets}
