"""Per-request sampling parameters, each declared once: its default, its help text and
how the job layer reads it (`param`). A job's per-row columns, its flags and job-file
keys, and the OpenAI batch body fields are derived from these fields (`jobs/params.py`,
`jobs/flags.py`, `jobs/spec.py`, `jobs/openai_batch.py`); a new parameter is one field
here, plus its check in `validate()`.

vLLM's keywords that are no fields (`guided_decoding=` / `structured_outputs=`, read as
the constraint fields; `spaces_between_special_tokens=`, a no-op) are init-only: a job
never sees them."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass, field

# The most top tokens logprobs / prompt_logprobs may ask for (vLLM's default, OpenAI's limit).
MAX_LOGPROBS = 20
_SAME = object()  # a job's default is the engine's


def param(default, help: str, *, kind: type = str, job_default=_SAME,
          body: tuple[str, ...] = ()):
    """A sampling field with its metadata. `help`: its `fusegen run` flag's help text.
    `kind`: how a text cell or a flag is read: int, float or bool (a number or a word),
    list (a repeatable flag of strings, or of ints for a list[int] field), or str (text,
    or JSON text for a mapping). `job_default`: a job's default where it differs from
    the engine's. `body`: the OpenAI request body fields that set it."""
    metadata = {"help": help, "kind": kind, "body": body,
                "job_default": default if job_default is _SAME else job_default}
    if isinstance(default, list):
        return field(default_factory=list, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = param(  # the prompt does not count
        16, "Generated tokens per row at most.", kind=int, job_default=64,
        body=("max_tokens", "max_completion_tokens"))
    temperature: float = param(1.0, "Sampling temperature, 0 for greedy.", kind=float,
                               body=("temperature",))
    top_p: float = param(1.0, "Nucleus sampling mass, in (0, 1].", kind=float,
                         body=("top_p",))
    top_k: int = param(-1, "Keep the k most likely tokens, -1 (or 0) for all.", kind=int,
                       body=("top_k",))
    min_p: float = param(0.0, "Drop tokens below min_p x the top token's probability.",
                         kind=float, body=("min_p",))
    # A request's own generator: its output does not depend on what it is batched with.
    # A job's is the rows' base seed (`jobs/rows.py`).
    seed: int | None = param(
        None, "Base seed: row i samples with a seed derived from it and i, so output does "
        "not depend on batching, partitioning or resume.", kind=int, job_default=0,
        body=("seed",))
    stop: list[str] = param(  # cut from the text when produced
        [], "Stop string; repeat for several.", kind=list, body=("stop",))
    stop_token_ids: list[int] = param(
        [], "Token id that ends a row's generation; repeat for several.", kind=list,
        body=("stop_token_ids",))
    ignore_eos: bool = param(False, "Keep generating past end-of-sequence tokens.",
                             kind=bool, body=("ignore_eos",))
    # Completion i of a prompt is seeded with seed + i.
    n: int = param(1, "Completions per row, each an output row with its completion_index.",
                   kind=int, body=("n",))
    # Structured output (engine/structured.py), at most one of the four: the output is
    # constrained token by token to a JSON schema (a dict, or its JSON text), a regular
    # expression, one of a list of strings, or a Lark / GBNF grammar. (The guided_* body
    # fields are vLLM's OpenAI server's.)
    json_schema: dict | str | None = param(
        None, "Constrain output to a JSON Schema: its JSON text or a file holding it.",
        body=("response_format", "guided_json"))
    regex: str | None = param(None, "Constrain output to this regular expression.",
                              body=("guided_regex",))
    choice: list[str] | None = param(
        None, "Constrain output to one of these strings; repeat for each.", kind=list,
        body=("guided_choice",))
    grammar: str | None = param(None, "Constrain output to this Lark or GBNF grammar.",
                                body=("guided_grammar",))
    # Logits processors (engine/logits_processors.py), vLLM's and OpenAI's definitions:
    # penalties over generated tokens (logit -= presence * (count > 0) + frequency * count),
    presence_penalty: float = param(
        0.0, "Subtracted from the logit of every token generated so far, in [-2, 2].",
        kind=float, body=("presence_penalty",))
    frequency_penalty: float = param(
        0.0, "Subtracted per occurrence of a generated token, in [-2, 2].", kind=float,
        body=("frequency_penalty",))
    # transformers' rule over prompt and generated tokens: a seen token's logit is divided
    # by it (multiplied when negative); 1 disables it.
    repetition_penalty: float = param(
        1.0, "Divides positive (multiplies negative) logits of tokens in the prompt or "
        "output; > 0, 1 for none.", kind=float, body=("repetition_penalty",))
    min_tokens: int = param(
        0, "End-of-sequence and stop token ids are masked until this many tokens were "
        "generated.", kind=int, body=("min_tokens",))
    logit_bias: dict[int, float] | None = param(
        None, "JSON object of token id -> bias added to its logit (in [-100, 100]), e.g. "
        "'{\"50256\": -100}'.", body=("logit_bias",))
    # A word's last token is masked when the tokens before it were just generated (each
    # word with and without a leading space).
    bad_words: list[str] = param([], "A word that must not be generated; repeat for several.",
                                 kind=list)
    # Log-probabilities of the model's logits (before penalties and temperature): the
    # sampled token plus the top `logprobs` per generated token (0: the sampled token
    # alone), and per prompt token with `prompt_logprobs`. (OpenAI's body asks for them
    # in its own shape: `jobs/openai_batch.py`.)
    logprobs: int | None = param(
        None, "Top-k logprobs per generated token (0: the sampled token's only), as a "
        "`logprobs` list column.", kind=int)
    prompt_logprobs: int | None = param(
        None, "Top-k logprobs per prompt token, as a `prompt_logprobs` list column.",
        kind=int)
    # vLLM's detokenizer options (engine/detokenizer.py): the text leaves special tokens
    # out, and ends before the stop string or stop token that ended it.
    skip_special_tokens: bool = param(
        True, "Leave special tokens (<|im_end|>, </s>...) out of the generated text.",
        kind=bool, body=("skip_special_tokens",))
    include_stop_str_in_output: bool = param(
        False, "Keep the stop string (or the stop token's text) that ended a row at the end "
        "of its text.", kind=bool, body=("include_stop_str_in_output",))
    # vLLM's structured-output objects (GuidedDecodingParams / StructuredOutputsParams):
    # read into json_schema, regex, choice or grammar (`vllm_constraint` below).
    guided_decoding: InitVar[object] = None
    structured_outputs: InitVar[object] = None
    # vLLM (as transformers) applies it to slow tokenizers only; fusegen's tokenizers are
    # the `tokenizers` library's fast ones, whose decode it does not change.
    spaces_between_special_tokens: InitVar[bool] = True

    def __post_init__(self, guided_decoding=None, structured_outputs=None,
                      spaces_between_special_tokens=True):
        if not isinstance(spaces_between_special_tokens, bool):
            raise ValueError("spaces_between_special_tokens must be true or false, got "
                             f"{_show(spaces_between_special_tokens)}")
        if guided_decoding is not None or structured_outputs is not None:
            self._read_vllm_constraint(guided_decoding, structured_outputs)
        # Only None, one string or a collection become a list: anything else (a number, a
        # mapping whose keys would pass as strings) stays as given for validate() to name.
        self.stop = _as_list([self.stop] if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.bad_words = _as_list([self.bad_words] if isinstance(self.bad_words, str)
                                  else self.bad_words)
        if isinstance(self.logit_bias, dict):  # JSON objects have string keys: "50256"
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}

    def _read_vllm_constraint(self, guided_decoding, structured_outputs) -> None:
        """vLLM's constraint object as this request's constraint field; ValueError (as
        vLLM raises) for what fusegen cannot honour, naming what to use instead."""
        if guided_decoding is not None and structured_outputs is not None:
            raise ValueError("guided_decoding and structured_outputs both set a constraint; "
                             "pass one")
        name = "guided_decoding" if guided_decoding is not None else "structured_outputs"
        field_name, value = vllm_constraint(guided_decoding or structured_outputs, name)
        given = [n for n in ("json_schema", "regex", "choice", "grammar")
                 if getattr(self, n) is not None]
        if given:
            raise ValueError(f"{name} and {given[0]} both set a constraint; pass one")
        setattr(self, field_name, value)

    @property
    def needs_logits_processing(self) -> bool:
        """Whether a row sampled with these params needs more than temperature and top-k /
        top-p / min-p: a penalty, min_tokens, logit_bias, bad_words or logprobs."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0
                or bool(self.logit_bias) or bool(self.bad_words) or self.logprobs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> str | None:
        """The first broken limit as a user-facing message, or None when valid.

        The engine turns a message into an `invalid_params` error of that request
        only; the rest of the batch is unaffected.
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}"
        if not _is_int(self.n) or self.n < 1:
            return f"n must be an integer >= 1, got {_show(self.n)}"
        if not _is_number(self.temperature) or self.temperature != self.temperature \
                or self.temperature < 0:
            return f"temperature must be a number >= 0, got {_show(self.temperature)}"
        if not _is_finite(self.temperature):  # it goes into a float tensor
            return f"temperature must be finite, got {_show(self.temperature)}"
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {_show(self.top_p)}"
        if not _is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be an integer >= -1 (-1 or 0 disables it), got {_show(self.top_k)}"
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {_show(self.min_p)}"
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            # The generator takes 64 bits: a larger seed would fail the whole batch's step.
            return f"seed must be an integer in [0, 2**64) or None, got {_show(self.seed)}"
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s
                                                  for s in self.stop):
            return f"stop must be a list of non-empty strings, got {_show(self.stop)}"
        if not isinstance(self.stop_token_ids, list) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            return ("stop_token_ids must be non-negative integers, got "
                    f"{_show(self.stop_token_ids)}")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be true or false, got {_show(getattr(self, name))}"
        return _processor_problem(self) or _structured_problem(self)


FIELDS = tuple(dataclasses.fields(SamplingParams))
NAMES = tuple(f.name for f in FIELDS)


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured-output request (`SamplingParams(structured_outputs=...)`, or
    `guided_decoding=` under its older name, GuidedDecodingParams), one constraint of:
    `json` (a JSON schema: a dict, its JSON text, or a pydantic model class), `regex`,
    `choice` (a list of strings), `grammar` (Lark or GBNF), `json_object` (True: any JSON
    object). fusegen compiles every one with llguidance (vLLM's "guidance" backend), so
    `backend` and `disable_fallback` change nothing; its JSON is laid out as json.dumps
    writes it, never with free whitespace, as `disable_any_whitespace=True` asks.
    `whitespace_pattern`, `structural_tag` and `disable_additional_properties=True` are
    refused with what to use instead (`vllm_constraint` below)."""
    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.11


def _processor_problem(params: SamplingParams) -> str | None:
    """The logits processors' limits (vLLM's and OpenAI's); whether logit_bias's token ids
    are in the model's vocabulary is checked when the request is made."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _is_number(value) or not -2.0 <= value <= 2.0:
            return f"{name} must be in [-2, 2], got {_show(value)}"
    rep = params.repetition_penalty
    if not _is_number(rep) or not _is_finite(rep) or not rep > 0:
        return f"repetition_penalty must be a finite number > 0 (1 disables it), got {_show(rep)}"
    if not _is_int(params.min_tokens) or params.min_tokens < 0:
        return f"min_tokens must be an integer >= 0, got {_show(params.min_tokens)}"
    if params.min_tokens > params.max_tokens:
        return (f"min_tokens must be <= max_tokens ({params.max_tokens}), got "
                f"{params.min_tokens}")
    problem = _logit_bias_problem(params.logit_bias)
    if problem:
        return problem
    if not isinstance(params.bad_words, list) or any(
            not isinstance(w, str) or not w.strip() for w in params.bad_words):
        return f"bad_words must be a list of non-empty strings, got {_show(params.bad_words)}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            return f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {_show(value)}"
    return None


def _logit_bias_problem(bias) -> str | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return f"logit_bias must map token ids to numbers, got {_show(bias)}"
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            return f"logit_bias keys must be token ids (integers >= 0), got {_show(token)}"
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            return f"logit_bias values must be in [-100, 100], got {_show(value)} for token {token}"
    return None


def _structured_problem(params: SamplingParams) -> str | None:
    """The shape of the structured-output fields; whether a schema, regex or grammar
    compiles is checked when the request is made (engine/structured.py)."""
    given = [n for n in ("json_schema", "regex", "choice", "grammar")
             if getattr(params, n) is not None]
    if len(given) > 1:
        return ("set at most one of json_schema, regex, choice and grammar, got "
                f"{' and '.join(given)}")
    if params.json_schema is not None and not isinstance(params.json_schema, (dict, str)):
        return ("json_schema must be a JSON object or its JSON text, got "
                f"{_show(params.json_schema)}")
    for name in ("regex", "grammar"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            return f"{name} must be a non-empty string, got {_show(value)}"
    choice = params.choice
    if choice is not None and (not isinstance(choice, list) or not choice
                               or any(not isinstance(c, str) or not c for c in choice)):
        return f"choice must be a non-empty list of non-empty strings, got {_show(choice)}"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _show(value, limit: int = 200) -> str:
    """A value as an error message quotes it: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's int-to-text limit (4,300 digits)
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def vllm_constraint(params, name: str) -> tuple[str, object]:
    """vLLM's StructuredOutputsParams / GuidedDecodingParams (`name`: the keyword it came
    by), fusegen's class or vLLM's own (read by attribute), as (SamplingParams field,
    value). Raises ValueError naming what fusegen cannot honour and what to use instead."""
    for attr, instead in (
            ("whitespace_pattern", "fusegen writes JSON as json.dumps lays it out; give the "
                                   "schema an \"x-guidance\" whitespace setting instead"),
            ("structural_tag", "write the tags and their JSON bodies as a Lark grammar and "
                               "pass it as grammar")):
        if getattr(params, attr, None) is not None:
            raise ValueError(f"{name}.{attr}: fusegen does not support it; {instead}")
    if getattr(params, "disable_additional_properties", False):
        raise ValueError(f"{name}.disable_additional_properties: fusegen does not rewrite "
                         "schemas; add \"additionalProperties\": false to the schema's "
                         "objects instead")
    schema = getattr(params, "json", None)
    if hasattr(schema, "model_json_schema"):  # a pydantic model class, as vLLM takes
        schema = schema.model_json_schema()
    given = {"json_schema": schema,
             "json_object": {"type": "object"} if getattr(params, "json_object", None)
             else None,
             "regex": getattr(params, "regex", None),
             "choice": getattr(params, "choice", None),
             "grammar": getattr(params, "grammar", None)}
    given = {k: v for k, v in given.items() if v is not None}
    shown = {"json_schema": "json"}
    if len(given) != 1:
        names = " and ".join(shown.get(k, k) for k in given)
        raise ValueError(f"{name} must set one of json, json_object, regex, choice and "
                         f"grammar; got {names or 'none'}")
    (field, value), = given.items()
    if field == "choice" and isinstance(value, tuple):
        value = list(value)
    return ("json_schema" if field == "json_object" else field), value
