"""`radixkv doctor`: each cache-breaking cause in a log written here is found, named and located;
clean logs raise no alarm; the hit rate after the fixes is measured by a real cache."""

import json
import random

import pytest

from radixkv.apps import cli
from radixkv.doctor import diagnose, read_requests, render_bytes, stable_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]
SYSTEM = "You are a careful coding agent. Follow the rules below.\n" + "Rule: be exact. " * 40


def shuffled_keys(value, rng):
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffled_keys(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffled_keys(v, rng) for v in value]
    return value


def session_log(
    path, n_sessions=3, turns=4, system=lambda s, t: SYSTEM, tools=lambda s, t: TOOLS, history=None
):
    """Agent sessions: each turn resends the whole history plus a reply and a new question."""
    lines = []
    for s in range(n_sessions):
        msgs = [{"role": "user", "content": f"Task {s}: fix the failing test in module {s}."}]
        for t in range(turns):
            sent = [{"role": "system", "content": system(s, t)}, *msgs]
            if history:
                sent = history(sent, t)
            lines.append({"session": f"s{s}", "messages": sent, "tools": tools(s, t)})
            msgs = [
                *msgs,
                {"role": "assistant", "content": f"Step {t}: I looked at file {t}.py."},
                {"role": "user", "content": f"Tool output {t}: " + "x" * 50},
            ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def run_doctor(path, capsys):
    code = cli.main(["doctor", str(path)])
    return code, capsys.readouterr().out


def test_clean_logs_raise_no_alarm(tmp_path, capsys):
    # Stable prompts, tools in one order, a date that never changes, retries (a prefix resent).
    p = session_log(tmp_path / "clean.jsonl", system=lambda s, t: SYSTEM + "Today is 2025-03-01.")
    code, out = run_doctor(p, capsys)
    assert code == 0, out
    assert "no cache-breaking prompts found" in out
    report = diagnose(read_requests(p))
    assert report.findings == []
    assert report.hit_rate_fixed == pytest.approx(report.hit_rate_logged)
    assert report.hit_rate_logged > 0.6
    # Sessions without a session field, grouped by their first user message; one a retry.
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    for x in lines:
        del x["session"]
    lines.append(lines[1])
    p.write_text("\n".join(json.dumps(x) for x in lines))
    assert diagnose(read_requests(p)).findings == []


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (lambda s, t: f"Current time: 2025-03-01T10:{10 + 4 * s + t}:07Z", "timestamp"),
        (
            lambda s, t: f"Request id: {random.Random(4 * s + t).getrandbits(128):032x}",
            "request id",
        ),
        (
            lambda s, t: (
                f"Trace 123e4567-e89b-12d3-a456-{random.Random(4 * s + t).getrandbits(48):012x}"
            ),
            "UUID",
        ),
        (lambda s, t: f"Today is March {4 * s + t + 1}, 2025.", "date"),
        (lambda s, t: f"This is turn {4 * s + t + 1} of the session.", "counter"),
    ],
)
def test_volatile_value_in_the_system_prompt(tmp_path, capsys, value, kind):
    p = session_log(tmp_path / "v.jsonl", system=lambda s, t: value(s, t) + "\n" + SYSTEM)
    report = diagnose(read_requests(p))
    assert len(report.findings) == 3 * 3  # every turn after the first, in each session
    f = report.findings[0]
    assert f.cause == "volatile value" and f.location.startswith("system prompt, char ")
    assert kind in f.fix and "system prompt" in f.fix
    assert f.kept < 60  # the break is at the very top
    # Moving the value to the end gets the history back.
    assert report.hit_rate_logged < 0.3 < 0.6 < report.hit_rate_fixed
    code, out = run_doctor(p, capsys)
    assert code == 1 and "volatile value" in out and "after fixes" in out


def test_tool_order_and_key_order(tmp_path):
    p = session_log(tmp_path / "order.jsonl", tools=lambda s, t: TOOLS[:: 1 if t % 2 else -1])
    r = diagnose(read_requests(p))
    assert {f.cause for f in r.findings} == {"tool order changed"}
    clean = diagnose(read_requests(session_log(tmp_path / "clean.jsonl"))).hit_rate_logged
    assert "stable_tools" in r.findings[0].fix
    assert r.hit_rate_logged < clean - 0.05 and r.hit_rate_fixed == pytest.approx(clean)
    p = session_log(
        tmp_path / "keys.jsonl", tools=lambda s, t: shuffled_keys(TOOLS, random.Random(t))
    )
    r = diagnose(read_requests(p))
    assert r.findings and {f.cause for f in r.findings} == {"tool key order changed"}
    assert r.hit_rate_logged < clean - 0.05 and r.hit_rate_fixed == pytest.approx(clean)
    # A real change of the tool set is named as such, not as an ordering problem.
    p = session_log(tmp_path / "set.jsonl", tools=lambda s, t: TOOLS[: 1 + t % 2])
    assert {f.cause for f in diagnose(read_requests(p)).findings} == {"tools changed"}


def test_the_table_says_what_prefix_lengths_count(tmp_path):
    """The "prefix kept" column counts bytes of the rendered text, or tokens with a
    tokenizer's renderer, and says which."""
    import zlib

    import numpy as np

    p = session_log(tmp_path / "order.jsonl", tools=lambda s, t: TOOLS[:: 1 if t % 2 else -1])
    requests = read_requests(p)
    by_bytes = diagnose(requests)
    f = by_bytes.findings[0]
    assert by_bytes.unit == "bytes"
    assert f"(at {f.kept:,} of {f.expected:,} bytes)" in by_bytes.table()

    def words(req, tools):  # a stand-in tokenizer: one token per word of the rendered bytes
        text = render_bytes(req.messages, tools).split()
        return np.asarray([zlib.crc32(w) % 50_000 for w in text], dtype=np.uint32)

    by_words = diagnose(requests, words)
    g = by_words.findings[0]
    assert by_words.unit == "tokens" and g.expected < f.expected
    assert f"(at {g.kept:,} of {g.expected:,} tokens)" in by_words.table()


def test_edited_system_prompt_and_rewritten_history(tmp_path):
    p = session_log(
        tmp_path / "edit.jsonl",
        system=lambda s, t: SYSTEM.replace("careful", ["careful", "terse", "kind", "bold"][t]),
    )
    r = diagnose(read_requests(p))
    assert {f.cause for f in r.findings} == {"system prompt edited"}
    assert "'careful' -> 'terse'" in r.findings[0].location
    # No automatic fix for a real edit: the hit rate stays.
    assert r.hit_rate_fixed == pytest.approx(r.hit_rate_logged)

    def summarize(msgs, t):  # from turn 2 on, the first exchange is replaced by a summary
        if t >= 2:
            return [msgs[0], {"role": "user", "content": "Summary of earlier work."}, *msgs[4:]]
        return msgs

    r = diagnose(read_requests(session_log(tmp_path / "sum.jsonl", history=summarize)))
    assert [f.cause for f in r.findings] == ["history rewritten"] * 3
    assert r.findings[0].location.startswith("messages[1] (user)")


def test_stable_tools_is_canonical():
    rng = random.Random(0)
    a = stable_tools(TOOLS)
    for _ in range(5):
        perm = shuffled_keys(TOOLS[::-1] if rng.random() < 0.5 else TOOLS, rng)
        b = stable_tools(perm)
        assert json.dumps(b) == json.dumps(a)
        assert render_bytes([{"role": "user", "content": "hi"}], b) == render_bytes(
            [{"role": "user", "content": "hi"}], a
        )
    assert [t["function"]["name"] for t in a] == ["read_file", "search"]
    assert list(a[1]["function"]) == ["description", "name", "parameters"]
    assert a[1]["function"]["parameters"]["required"] == ["query"]  # lists keep their order
    assert stable_tools(None) == []
    with pytest.raises(TypeError, match="tools must be a list"):
        stable_tools({"name": "x"})


def test_bad_input_is_named(tmp_path, capsys):
    """A user error, not a finding: one line on stderr, exit status 2 (findings exit 1)."""
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "x"}\n')
    assert cli.main(["doctor", str(p)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixkv: error: doctor: "), err
    assert "line 2: needs a non-empty 'messages' list" in err[0]
    assert captured.out == ""


def real_tokenizer_dir():
    """The real model's converted checkpoint (its tokenizer has a chat template), or skip."""
    pytest.importorskip("transformers")
    from radixkv.hf import _load

    if _load.smollm2_path() is None:  # pragma: no cover - make test installs it
        pytest.skip(f"the real model is not installed: {_load.SMOLLM2_INSTALL}")
    return _load._converted(_load.smollm2_path())


def test_doctor_renders_through_a_real_tokenizer(tmp_path, capsys):
    """With --tokenizer, prompts are rendered with the real chat template (transformers 5's
    apply_chat_template(tokenize=True) returns a mapping, which broke every log)."""
    directory = real_tokenizer_dir()
    clean = session_log(tmp_path / "clean.jsonl")
    code = cli.main(["doctor", str(clean), "--tokenizer", str(directory)])
    out = capsys.readouterr().out
    assert code == 0, out
    dated = session_log(
        tmp_path / "dated.jsonl", system=lambda s, t: SYSTEM + f"Now: 2025-03-01T10:0{t}:00."
    )
    code = cli.main(["doctor", str(dated), "--tokenizer", str(directory)])
    out = capsys.readouterr().out
    assert "timestamp" in out or "volatile" in out or "system prompt" in out, out
    assert out != "" and code in (0, 1)
