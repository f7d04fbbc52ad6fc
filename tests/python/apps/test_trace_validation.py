"""Malformed traces (``radixkv replay TRACE``) and request logs (``radixkv doctor LOG``): every
bad line is one line on stderr, ``radixkv: error: ...``, naming the line and the field, with exit
status 2, never a traceback; fuzzed over arbitrary JSON values, dicts of the real field names and
raw bytes, each input either reads or gives that one clean line.

The CLI runs in-process (:func:`radixkv.apps.cli.main`), as in ``test_doctor.py``: a user error
is found before anything is replayed, so each case takes milliseconds."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import budget
from radixkv.apps import cli
from radixkv.apps.common.args import UsageError
from radixkv.apps.common.trace import TraceError, read_trace
from radixkv.apps.replay import cmd as replay_cmd

#: A valid line of each format, written before the bad line and a blank line: every bad trace
#: line is line 4 of its file, every bad log line line 3.
GOOD_TRACE = (
    '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
    '{"timestamp": 0.5, "tokens": [1, 2, 3], "output_length": 2}\n'
)
GOOD_LOG = '{"session": "s", "messages": [{"role": "user", "content": "hi"}]}\n\n'

MOONCAKE = {"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [1]}
RADIXKV = {"timestamp": 0.5, "tokens": [1, 2, 3], "output_length": 2}


#: A field value written as JSON null (``None`` leaves the field out).
NULL = "<null>"


def mooncake(**fields) -> str:
    """A Mooncake line with ``fields`` replaced (``None``: left out, :data:`NULL`: null)."""
    return _line(MOONCAKE, fields)


def tokens_line(**fields) -> str:
    """A radixkv tokens line with ``fields`` replaced (``None``: left out, :data:`NULL`: null)."""
    return _line(RADIXKV, fields)


def _line(base: dict, fields: dict) -> str:
    obj = {**base, **fields}
    return json.dumps({k: v for k, v in obj.items() if v is not None}).replace(f'"{NULL}"', "null")


#: (case id, bad line, what the one error line must hold besides the line number).
TRACE_CASES = [
    ("line-is-a-number", "5", ["must be a JSON object", "got 5"]),
    ("line-is-null", "null", ["must be a JSON object", "got null"]),
    ("line-is-a-list", "[1, 2]", ["must be a JSON object", "[1, 2]"]),
    ("text-is-a-number", '{"text": 5}', ["'text'", "got 5"]),
    ("text-is-empty", '{"text": ""}', ["'text'", "empty"]),
    ("tokens-nested", tokens_line(tokens=[1, [2, 3]]), ["'tokens'[1]", "[2, 3]"]),
    ("tokens-a-string", tokens_line(tokens=[1, "a"]), ["'tokens'[1]", '"a"']),
    ("tokens-not-a-list", tokens_line(tokens=7), ["'tokens'", "got 7"]),
    ("tokens-empty", tokens_line(tokens=[]), ["'tokens'", "empty"]),
    ("tokens-float", tokens_line(tokens=[1, 2.5]), ["'tokens'[1]", "2.5"]),
    ("tokens-integral-float", tokens_line(tokens=[1, 2.0]), ["'tokens'[1]", "2.0"]),
    ("tokens-bool", tokens_line(tokens=[True, 2]), ["'tokens'[0]", "true"]),
    ("tokens-beyond-u32", tokens_line(tokens=[1, 2**32]), ["'tokens'[1]", str(2**32)]),
    ("tokens-negative", tokens_line(tokens=[-1]), ["'tokens'[0]", "-1"]),
    ("timestamp-null", tokens_line(timestamp=NULL), ["'timestamp'", "got null"]),
    ("timestamp-a-string", tokens_line(timestamp="x"), ["'timestamp'", 'got "x"']),
    ("timestamp-bool", tokens_line(timestamp=True), ["'timestamp'", "got true"]),
    ("timestamp-negative", tokens_line(timestamp=-1.5), ["'timestamp'", "-1.5"]),
    ("timestamp-nan", '{"timestamp": NaN, "tokens": [1]}', ["'timestamp'", "NaN"]),
    ("timestamp-inf", '{"timestamp": Infinity, "tokens": [1]}', ["'timestamp'", "Infinity"]),
    ("timestamp-huge-int", tokens_line(timestamp=10**400), ["'timestamp'"]),
    ("mooncake-timestamp-missing", mooncake(timestamp=None), ["'timestamp'", "missing"]),
    ("mooncake-timestamp-null", mooncake(timestamp=NULL), ["'timestamp'", "got null"]),
    ("mooncake-timestamp-a-string", mooncake(timestamp="x"), ["'timestamp'", 'got "x"']),
    ("mooncake-timestamp-nan", mooncake(timestamp=math.nan), ["'timestamp'", "NaN"]),
    ("mooncake-timestamp-inf", mooncake(timestamp=-math.inf), ["'timestamp'", "-Infinity"]),
    ("output-length-null", tokens_line(output_length=NULL), ["'output_length'", "got null"]),
    ("output-length-negative", tokens_line(output_length=-2), ["'output_length'", "got -2"]),
    ("output-length-float", tokens_line(output_length=2.5), ["'output_length'", "got 2.5"]),
    ("output-length-bool", tokens_line(output_length=True), ["'output_length'", "got true"]),
    ("output-length-beyond-u32", mooncake(output_length=2**32), ["'output_length'", str(2**32)]),
    ("mooncake-output-length-negative", mooncake(output_length=-2), ["'output_length'", "-2"]),
    ("namespace-a-number", tokens_line(namespace=5), ["'namespace'", "got 5"]),
    ("namespace-a-list", tokens_line(namespace=["a"]), ["'namespace'", '["a"]']),
    ("hash-ids-empty", mooncake(hash_ids=[], input_length=1), ["'hash_ids'", "empty"]),
    ("hash-ids-not-a-list", mooncake(hash_ids=3), ["'hash_ids'", "got 3"]),
    ("hash-ids-a-string", mooncake(hash_ids=[1, "x"]), ["'hash_ids'[1]", '"x"']),
    ("hash-ids-beyond-u32", mooncake(hash_ids=[2**32]), ["'hash_ids'[0]", str(2**32)]),
    # Id 2**32 / 512 would expand to tokens 2**32 ...: beyond uint32 too.
    ("hash-ids-beyond-u32-tokens", mooncake(hash_ids=[2**23]), ["'hash_ids'[0]", str(2**23)]),
    ("hash-ids-float", mooncake(hash_ids=[1.0]), ["'hash_ids'[0]", "1.0"]),
    ("hash-ids-bool", mooncake(hash_ids=[False]), ["'hash_ids'[0]", "false"]),
    ("input-length-negative", mooncake(input_length=-3), ["'input_length'", "got -3"]),
    ("input-length-zero", mooncake(input_length=0), ["'input_length'", "got 0"]),
    ("input-length-beyond-blocks", mooncake(input_length=513), ["'input_length'", "513"]),
    ("input-length-missing", mooncake(input_length=None), ["'input_length'", "missing"]),
    ("input-length-a-string", mooncake(input_length="5"), ["'input_length'", '"5"']),
    ("input-length-float", mooncake(input_length=5.0), ["'input_length'", "5.0"]),
    ("no-prompt", '{"timestamp": 1}', ["'hash_ids', 'tokens' or 'text'"]),
    ("not-json", "{not json", ["not JSON"]),
    ("deeply-nested", "[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    ("deeply-nested-field", '{"tokens": ' + "[" * 100_000, ["nested too deeply"]),
    ("huge-int", '{"tokens": [' + "9" * 5000 + "]}", ["JSON"]),
    ("text-lone-surrogate", '{"text": "a\\ud800"}', ["'text'", "surrogate"]),
    ("namespace-lone-surrogate", '{"tokens": [1], "namespace": "\\udc00"}', ["'namespace'"]),
]


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``radixkv ARGV`` in-process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> str:
    """Exit status 2, nothing on stdout, one line on stderr holding each of ``needles``."""
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out == ""
    return lines[0]


@pytest.mark.parametrize(
    ("line", "needles"), [c[1:] for c in TRACE_CASES], ids=[c[0] for c in TRACE_CASES]
)
def test_replay_names_the_line_and_field_of_a_bad_trace_line(tmp_path, line, needles):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD_TRACE + "\n" + line + "\n")
    code, out, err = run_cli("replay", str(path), "--no-chart")
    msg = assert_one_line_error(code, out, err, f"replay: {path}: line 4: ", *needles)
    assert len(msg) < 300, msg


DEV_NULL = pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null")


@DEV_NULL
def test_replay_of_an_empty_file_says_it_is_empty(tmp_path):
    code, out, err = run_cli("replay", "/dev/null", "--no-chart")
    assert_one_line_error(code, out, err, "no requests in /dev/null", "empty")
    assert "does not exist" not in err
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    code, out, err = run_cli("replay", str(blank), "--no-chart")
    assert_one_line_error(code, out, err, "no requests in", "blank lines")
    code, out, err = run_cli("replay", str(tmp_path / "nope.jsonl"), "--no-chart")
    assert_one_line_error(code, out, err, "does not exist")


def test_replay_of_a_corrupt_gzip_is_one_line(tmp_path):
    for data in (b"\x1f\x8b", b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage", b"not gzip"):
        path = tmp_path / "trace.jsonl.gz"
        path.write_bytes(data)
        code, out, err = run_cli("replay", str(path), "--no-chart")
        assert_one_line_error(code, out, err, "cannot read trace")


@pytest.mark.parametrize(
    "line",
    [
        '{"timestamp": 0, "input_length": 512, "hash_ids": [8388607]}',  # the largest hash id
        '{"timestamp": 1.5e3, "input_length": 1, "output_length": 0, "hash_ids": [0, 0]}',
        '{"tokens": [0, 4294967295]}',  # the largest token id
        '{"tokens": [1], "namespace": null, "timestamp": 3, "output_length": 4294967295}',
        '{"text": "h\\u00e9 \\ud83d\\ude00", "namespace": "tenant-a", "extra": [[[{}]]]}',
    ],
)
def test_valid_lines_stay_valid(tmp_path, line):
    path = tmp_path / "trace.jsonl"
    path.write_text(line + "\n")
    (req,) = replay_cmd._read(str(path), None)
    assert req.tokens.dtype == np.uint32 and len(req.tokens) > 0
    assert math.isfinite(req.arrival) and 0 <= req.output_length < 2**32


def test_trace_errors_are_value_errors(tmp_path):
    """:func:`read_trace` raises :class:`TraceError`, a ``ValueError`` as before."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"tokens": [1]}\n{"tokens": [1], "output_length": -1}\n')
    with pytest.raises(TraceError, match="line 2: 'output_length'") as info:
        list(read_trace(path))
    assert isinstance(info.value, ValueError)


# ---- radixkv doctor ---------------------------------------------------------------------------


def chat(**fields) -> str:
    """A chat request line with ``fields`` replaced."""
    return json.dumps({"session": "s", "messages": [{"role": "user", "content": "hi"}], **fields})


def message(**fields) -> str:
    """A chat request whose one message has ``fields`` replaced."""
    return chat(messages=[{"role": "user", "content": "hi", **fields}])


DOCTOR_CASES = [
    ("line-is-a-number", "5", ["must be a JSON object", "got 5"]),
    ("line-is-null", "null", ["must be a JSON object", "got null"]),
    ("messages-missing", '{"prompt": "x"}', ["'messages'", "got no 'messages'"]),
    ("messages-empty", chat(messages=[]), ["'messages'", "got []"]),
    ("messages-not-objects", chat(messages=["hi"]), ["'messages'", '["hi"]']),
    ("role-a-number", message(role=5), ["'messages'[0].role", "got 5"]),
    ("content-a-number", message(content=5), ["'messages'[0].content", "got 5"]),
    ("content-an-object", message(content={"a": 1}), ["'messages'[0].content", '{"a": 1}']),
    ("content-part-a-number", message(content=["a", 5]), ["'messages'[0].content[1]", "5"]),
    ("part-text-a-number", message(content=[{"text": 5}]), ["content[0].text", "got 5"]),
    ("tool-calls-a-string", message(tool_calls="x"), ["'messages'[0].tool_calls", '"x"']),
    ("tools-a-string", chat(tools="x"), ["'tools'", 'got "x"']),
    ("tools-not-objects", chat(tools=[{}, 5]), ["'tools'[1]", "got 5"]),
    ("session-a-list", chat(session=[1]), ["'session'", "got [1]"]),
    ("session-a-bool", chat(session=True), ["'session'", "got true"]),
    ("not-json", "{not json", ["not JSON"]),
    ("deeply-nested", "[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    (
        "nested-deeper-than-tools-render",
        chat(tools=[json.loads("[" * 500 + "]" * 500)]),
        ["nested deeper"],
    ),
    ("lone-surrogate", message(content="a\ud800"), ["not valid unicode"]),
    ("huge-int", '{"messages": [' + "9" * 5000 + "]}", ["JSON"]),
]


@pytest.mark.parametrize(
    ("line", "needles"), [c[1:] for c in DOCTOR_CASES], ids=[c[0] for c in DOCTOR_CASES]
)
def test_doctor_names_the_line_and_field_of_a_bad_request(tmp_path, line, needles):
    path = tmp_path / "log.jsonl"
    path.write_text(GOOD_LOG + line + "\n")
    code, out, err = run_cli("doctor", str(path))
    assert_one_line_error(code, out, err, f"doctor: {path}: line 3: ", *needles)


@DEV_NULL
def test_doctor_of_an_empty_file_says_it_is_empty():
    code, out, err = run_cli("doctor", "/dev/null")
    assert_one_line_error(code, out, err, "no requests in /dev/null", "empty")


def test_doctor_names_a_role_change_of_the_system_prompt(tmp_path):
    """Same system prompt text, another role: a finding (exit 1), not an AssertionError."""
    path = tmp_path / "log.jsonl"
    rows = [
        {"session": "s", "messages": [{"role": role, "content": "You are terse."}]}
        for role in ("system", "developer")
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("doctor", str(path))
    assert (code, err) == (1, "")
    assert "system prompt edited" in out and "'system' -> 'developer'" in out


def test_doctor_accepts_integer_sessions_and_content_parts(tmp_path):
    path = tmp_path / "log.jsonl"
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    rows = [{"session": 7, "messages": [{"role": "user", "content": parts}]}] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("doctor", str(path))
    assert (code, err) == (0, ""), err
    assert "no cache-breaking prompts found" in out


# ---- fuzzing ----------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=budget.examples(200, 50),
    derandomize=budget.derandomize(),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: Strings with lone surrogates: JSON's "\ud800" parses, but has no utf-8 (st.text never
#: draws one).
SURROGATES = st.lists(st.characters(categories=["Cs"]) | st.characters(), max_size=4).map("".join)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-3, 600)
    | st.sampled_from([2**23 - 1, 2**23, 2**32 - 1, 2**32, 2**63, 10**30])
    | st.floats()
    | st.text(max_size=12)
    | SURROGATES
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
#: Values a field may have: anything, or something close to valid.
FIELD = (
    JSON
    | st.lists(st.integers(-2, 2**32 + 1), max_size=6)
    | st.lists(st.integers(0, 40), min_size=1, max_size=6)
)

TRACE_FIELDS = [
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "tokens",
    "text",
    "namespace",
]
NAMESPACE = st.none() | st.sampled_from(["a", "tenant-b"]) | st.text(max_size=6) | SURROGATES


@st.composite
def valid_trace_lines(draw) -> dict:
    """A valid line of either format, optional fields drawn in or left out."""
    kind = draw(st.sampled_from(["mooncake", "tokens", "text"]))
    if kind == "mooncake":
        ids = draw(st.lists(st.integers(0, 2**23 - 1) | st.integers(0, 9), min_size=1, max_size=3))
        obj = {
            "timestamp": draw(st.integers(0, 10**6) | st.floats(0, 1e6)),
            "input_length": draw(st.integers(1, 512 * len(ids))),
            "hash_ids": ids,
        }
    else:
        obj = {"timestamp": draw(st.floats(0, 1e3))}
        if kind == "tokens":
            obj["tokens"] = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8))
        else:
            obj["text"] = draw(st.text(min_size=1, max_size=12))
        obj["namespace"] = draw(NAMESPACE)
    # Now and then the largest output length: a request no pool holds (dropped, or refused).
    obj["output_length"] = draw(st.integers(0, 64) | st.integers(0, 8) | st.just(2**32 - 1))
    optional = ["namespace", "output_length"] + ([] if kind == "mooncake" else ["timestamp"])
    drop = draw(st.sets(st.sampled_from(optional)))
    return {k: v for k, v in obj.items() if k not in drop}


@st.composite
def mutated(draw, valid: st.SearchStrategy, fields: list[str]) -> dict:
    """A valid object with one of ``fields`` set to any value, or removed."""
    obj = dict(draw(valid))
    key = draw(st.sampled_from(fields))
    if draw(st.booleans()):
        obj.pop(key, None)
    else:
        obj[key] = draw(FIELD | SURROGATES)
    return obj


#: Trace lines: valid ones, valid ones with one field broken, and dicts of the field names with
#: values of any type.
TRACE_DICTS = (
    valid_trace_lines()
    | mutated(valid_trace_lines(), TRACE_FIELDS)
    | st.fixed_dictionaries({}, optional={k: FIELD for k in TRACE_FIELDS})
)

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
TEXTS = st.sampled_from(["You are terse.", "Now: 2025-03-01T10:01:07Z", "hi", "Turn 3", ""])
MESSAGE_FIELDS = ["role", "content", "tool_calls", "name"]
#: Content: a string, or a list of parts (strings and text parts).
PARTS = st.lists(
    TEXTS | st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS}), max_size=2
)
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": ROLES, "content": TEXTS | st.text(max_size=8) | PARTS}
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.sampled_from("ab")}),
    }
)
CHAT_FIELDS = ["messages", "tools", "session"]


@st.composite
def valid_chats(draw) -> dict:
    """A valid chat request: messages of known roles, maybe tools, maybe a session."""
    obj = {"messages": draw(st.lists(VALID_MESSAGE, min_size=1, max_size=3))}
    if draw(st.booleans()):
        obj["tools"] = draw(st.lists(TOOL, max_size=2))
    if draw(st.booleans()):
        obj["session"] = draw(st.sampled_from(["s", "t", 3]))
    return obj


@st.composite
def chats_with_a_bad_message(draw) -> dict:
    """A valid chat request with one field of one message set to any value, or removed."""
    obj = draw(valid_chats())
    msgs = [dict(m) for m in obj["messages"]]
    m = msgs[draw(st.integers(0, len(msgs) - 1))]
    key = draw(st.sampled_from(MESSAGE_FIELDS))
    if draw(st.booleans()):
        m.pop(key, None)
    else:
        m[key] = draw(FIELD | SURROGATES)
    return {**obj, "messages": msgs}


CHAT = (
    valid_chats()
    | mutated(valid_chats(), CHAT_FIELDS)
    | chats_with_a_bad_message()
    | st.fixed_dictionaries({}, optional={k: FIELD for k in CHAT_FIELDS})
)
#: Chat requests, plain or wrapped as a proxy logs them ({"request": ...} or {"body": ...}).
CHAT_DICTS = CHAT | st.fixed_dictionaries(
    {}, optional={"request": CHAT, "body": CHAT, "session": JSON}
)


def as_lines(values: list) -> bytes:
    """JSON values, one a line (``NaN`` and ``Infinity`` as Python writes them)."""
    return "".join(json.dumps(v) + "\n" for v in values).encode()


def raw_lines(lines: list[bytes], prefix: bytes) -> bytes:
    return prefix + b"\n".join(lines) + b"\n"


RAW = st.builds(
    raw_lines,
    st.lists(st.binary(max_size=24) | TRACE_DICTS.map(lambda d: as_lines([d])[:-1]), max_size=4),
    st.sampled_from([b"", b"", b"\x1f\x8b", b"\xef\xbb\xbf"]),
)
RAW_CHAT = st.builds(
    raw_lines,
    st.lists(st.binary(max_size=24) | CHAT_DICTS.map(lambda d: as_lines([d])[:-1]), max_size=4),
    st.sampled_from([b"", b"", b"\xef\xbb\xbf"]),
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def check_trace(path: Path, data: bytes) -> None:
    """The trace ``data`` reads into sane requests or gives one clean line, nothing else."""
    path.write_bytes(data)
    try:
        requests = replay_cmd._read(str(path), None)
    except UsageError as e:
        assert len(str(e).splitlines()) == 1 and str(e).startswith("replay: "), str(e)
        return
    for r in requests:
        assert r.tokens.dtype == np.uint32 and r.tokens.ndim == 1 and len(r.tokens) > 0
        assert math.isfinite(r.arrival) and r.arrival >= 0
        assert type(r.output_length) is int and 0 <= r.output_length < 2**32
        assert r.namespace is None or isinstance(r.namespace, str)


def check_doctor(path: Path, data: bytes) -> None:
    """``radixkv doctor`` on ``data``: a result (exit 0 or 1, nothing on stderr) or one clean
    line with exit status 2."""
    path.write_bytes(data)
    code, out, err = run_cli("doctor", str(path))
    if code == 2:
        assert_one_line_error(code, out, err, "doctor: ")
    else:
        assert code in (0, 1) and err == "", (code, err)


@FUZZ
@given(st.lists(JSON | TRACE_DICTS, min_size=1, max_size=4))
def test_fuzz_trace_json_values(fuzz_dir, values):
    check_trace(fuzz_dir / "trace.jsonl", as_lines(values))


@FUZZ
@given(RAW)
def test_fuzz_trace_raw_bytes(fuzz_dir, data):
    check_trace(fuzz_dir / "trace.jsonl", data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(TRACE_DICTS, min_size=1, max_size=3))
def test_fuzz_replay_runs_whatever_the_reader_accepts(fuzz_dir, values):
    """What the reader accepts, the replay runs (exit 0); what it refuses is one line."""
    path = fuzz_dir / "replayed.jsonl"
    path.write_bytes(as_lines(values))
    code, out, err = run_cli(
        "replay", str(path), "--policy", "fcfs", "--no-chart", "--num-pages", "256"
    )
    if code == 2:
        assert_one_line_error(code, out, err, "replay: ")
    else:
        assert code == 0 and "Traceback" not in err, err


@FUZZ
@given(st.lists(JSON | CHAT_DICTS, min_size=1, max_size=4))
def test_fuzz_doctor_json_values(fuzz_dir, values):
    check_doctor(fuzz_dir / "log.jsonl", as_lines(values))


@FUZZ
@given(RAW_CHAT)
def test_fuzz_doctor_raw_bytes(fuzz_dir, data):
    check_doctor(fuzz_dir / "log.jsonl", data)
