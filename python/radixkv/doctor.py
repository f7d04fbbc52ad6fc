"""Why a prompt log misses the prefix cache: ``radixkv doctor REQUESTS.jsonl``.

A prefix cache serves a request only up to the first token that differs from what it has seen.
In a chat or agent session each request should extend the one before it, so the whole history is
a cache hit; the usual reason it is not is the prompt, not the cache. This module reads a log of
chat requests (one OpenAI-format request per line: ``{"messages": [...], "tools": [...],
"session": "..."}``, ``session`` optional), renders each one, and for each request finds where it
stops sharing a prefix with the previous request of its session and why:

- ``volatile value``: a timestamp, date, time, UUID, request id, epoch or counter in the system
  prompt or an early message changed between turns;
- ``tool order changed`` / ``tool key order changed``: the same tool schemas, serialized in
  another order (fix: :func:`stable_tools`); ``tools changed``: the schemas themselves differ;
- ``system prompt edited``: another edit of the system prompt;
- ``history rewritten``: an earlier message was edited, removed or summarized.

Rendering: without a tokenizer a request is rendered to bytes by a fixed chat layout (system
prompt, then the tools as JSON exactly as logged, then each message) and every byte is a token;
with a local Hugging Face tokenizer (``--tokenizer DIR``) its chat template renders token ids.

The hit rate of the log is measured by replaying the rendered requests in order through a
:class:`radixkv.RadixCache` large enough to hold them all, once as logged and once after the
fixes the doctor can apply by itself (tools through :func:`stable_tools`, the volatile values it
found moved to the end of the last message).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import radixkv
from radixkv._jsonl import load as load_json
from radixkv._jsonl import show

__all__ = [
    "Finding",
    "Report",
    "diagnose",
    "read_requests",
    "render_bytes",
    "stable_tools",
]

#: Volatile values, most specific first: (kind, pattern).
VOLATILE: list[tuple[str, re.Pattern[str]]] = [
    (
        "UUID",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
    ),
    (
        "timestamp",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?"
            r"(?:\s?(?:Z|UTC|[+-]\d{2}:?\d{2}))?"
        ),
    ),
    (
        "date",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
            r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?\s+|"
            r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2}(?:st|nd|rd|th)?"
            r"(?:,?\s+\d{4})?\b|\b\d{1,2}\s+(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*"
            r"\.?(?:\s+\d{4})?\b"
        ),
    ),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?\b")),
    ("epoch", re.compile(r"\b1[4-9]\d{8}(?:\d{3})?(?:\.\d+)?\b")),
    (
        "request id",
        re.compile(
            r"(?i)\b(?:req(?:uest)?|trace|span|session|conversation|call|run|correlation|msg|id)"
            r"[-_ ]?(?:id)?\s*[:=#]?\s*[\"']?[A-Za-z0-9][A-Za-z0-9_-]{5,}"
        ),
    ),
    ("hex id", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b")),
]

FIXES = {
    "volatile value": "move the {what} out of the {where} to the end of the prompt (or drop it)",
    "tool order changed": "send tools in one order: radixkv.doctor.stable_tools(tools)",
    "tool key order changed": "serialize tool schemas one way: radixkv.doctor.stable_tools(tools)",
    "tools changed": "keep one tool set per session; add new tools after the existing ones",
    "system prompt edited": "keep the system prompt fixed; put per-turn instructions in a "
    "later message",
    "history rewritten": "append to the history (summaries, corrections) instead of rewriting "
    "earlier messages",
}


# ---- input ----------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """One logged request: its messages, tools and session (``line``: 1-based line number)."""

    line: int
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    session: str


#: The deepest nesting of lists and objects a logged request may have: rendering, comparing and
#: canonicalizing tools recurse, and real requests (JSON schemas included) stay far shallower.
MAX_DEPTH = 100


def _load(raw: str, where: str) -> Any:
    """The JSON value on a line; ``ValueError`` naming the line when it is not JSON, nests
    deeper than :data:`MAX_DEPTH` or holds a string that is not valid unicode."""
    obj = load_json(raw, where, ValueError, "the doctor")
    _check_tree(obj, where)
    return obj


def _check_tree(obj: Any, where: str) -> None:
    """``ValueError`` when ``obj`` nests lists and objects deeper than :data:`MAX_DEPTH` or holds
    a string (value or key) with a lone surrogate (JSON's ``"\\ud800"``, which has no utf-8).
    Iterative: no recursion, whatever the depth."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, where)
            continue
        if not isinstance(value, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels of lists and objects")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, where)
                stack.append((v, depth + 1))
        else:
            stack.extend((v, depth + 1) for v in value)


def _check_unicode(text: str, where: str) -> None:
    """``ValueError`` when ``text`` holds a lone surrogate, named with its neighbourhood."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: a string is not valid unicode (a lone surrogate at character {e.start} of "
            f"{show(text, 40)})"
        ) from None


def _check_message(m: dict[str, Any], i: int, where: str) -> None:
    """``ValueError`` naming the field of message ``i`` that has the wrong type: ``role`` a
    string, ``content`` a string, a list of parts (strings or objects, a part's ``text`` a
    string) or null, ``tool_calls`` a list or null."""
    at = f"{where}: 'messages'[{i}]"
    if "role" in m and not isinstance(m["role"], str):
        raise ValueError(f"{at}.role must be a string, got {show(m['role'])}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(
            f"{at}.content must be a string, a list of parts or null, got {show(content)}"
        )
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, (str, dict)):
            raise ValueError(f"{at}.content[{j}] must be a string or an object, got {show(part)}")
        if isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
            raise ValueError(f"{at}.content[{j}].text must be a string, got {show(part['text'])}")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"{at}.tool_calls must be a list or null, got {show(calls)}")


def _request(obj: Any, n: int, where: str) -> ChatRequest:
    """Line ``n`` (its JSON value ``obj``) as a request; ``ValueError`` naming the line and the
    field that is missing or has the wrong type."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must be a JSON object, got {show(obj)}")
    # Logs of a proxy often wrap the body: {"request": {...}} or {"body": {...}}.
    for key in ("request", "body"):
        if isinstance(obj.get(key), dict) and "messages" not in obj:
            obj = {**obj[key], **{k: v for k, v in obj.items() if k == "session"}}
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        got = "no 'messages'" if msgs is None else show(msgs)
        raise ValueError(f"{where}: needs a non-empty 'messages' list of objects, got {got}")
    for i, m in enumerate(msgs):
        _check_message(m, i, where)
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: 'tools' must be a list, got {show(tools)}")
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: 'tools'[{i}] must be an object, got {show(tool)}")
    session = obj.get("session")
    if session is None:
        first_user = next((m for m in msgs if m.get("role") == "user"), msgs[0])
        session = "~" + _text(first_user.get("content"))[:40]
    elif isinstance(session, bool) or not isinstance(session, (str, int)):
        raise ValueError(f"{where}: 'session' must be a string or an integer, got {show(session)}")
    return ChatRequest(n, msgs, tools or None, str(session))


def read_requests(path: str | Path) -> list[ChatRequest]:
    """Reads a JSONL log of chat requests. A line is ``{"messages": [...]}`` with optional
    ``tools`` and ``session`` (requests without one are grouped by their first user message).
    Raises ``ValueError`` naming the line, and the field, of a malformed request."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}: line {n}"
            out.append(_request(_load(raw, where), n, where))
    return out


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined; None as empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                parts.append(str(p.get("text", json.dumps(p, ensure_ascii=False))))
            else:
                parts.append(str(p))
        return "".join(parts)
    return json.dumps(content, ensure_ascii=False)


# ---- canonical tools --------------------------------------------------------------------------


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
        if isinstance(tool.get("name"), str):
            return tool["name"]
    return ""


def stable_tools(tools: Iterable[Any] | None) -> list[Any]:
    """Tool schemas in a canonical form: tools sorted by name (``function.name`` or ``name``,
    then by their canonical JSON), and every object's keys sorted, recursively (lists keep their
    order). Rendering these gives the same bytes whatever order the caller built them in, so the
    tools block stays a cache hit. Returns new objects; ``None`` gives ``[]``."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, dict)):
        raise TypeError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    canon = [_sorted_keys(t) for t in tools]
    return sorted(canon, key=lambda t: (_tool_name(t), json.dumps(t, ensure_ascii=False)))


# ---- rendering --------------------------------------------------------------------------------


def _segments(req_messages: Sequence[dict], tools: list | None) -> list[tuple[str, str, str]]:
    """``(label, role, text)`` in render order: system prompt, tools, then each message."""
    segs = []
    msgs = list(req_messages)
    start = 0
    if msgs and msgs[0].get("role") in ("system", "developer"):
        segs.append(("system prompt", str(msgs[0]["role"]), _text(msgs[0].get("content"))))
        start = 1
    if tools:
        segs.append(("tools", "tools", json.dumps(tools, ensure_ascii=False)))
    for i in range(start, len(msgs)):
        m = msgs[i]
        role = str(m.get("role", "?"))
        text = _text(m.get("content"))
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], ensure_ascii=False)
        segs.append((f"messages[{i}] ({role})", role, text))
    return segs


def render_bytes(messages: Sequence[dict], tools: list | None = None) -> bytes:
    """The request rendered by a fixed chat layout, as utf-8 bytes: the system prompt, the tools
    as JSON exactly as given (key order included), each message, and the assistant prompt."""
    body = "".join(f"<|{role}|>\n{text}\n" for _, role, text in _segments(messages, tools))
    return (body + "<|assistant|>\n").encode()


def _byte_renderer(req: ChatRequest, tools: list | None) -> np.ndarray:
    return np.frombuffer(render_bytes(req.messages, tools), dtype=np.uint8).astype(np.uint32)


def tokenizer_renderer(path: str | Path) -> Callable[[ChatRequest, list | None], np.ndarray]:
    """A renderer through a local Hugging Face tokenizer's chat template (needs transformers)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit(
            "radixkv doctor: --tokenizer needs the transformers package (pip install "
            "transformers); without --tokenizer the doctor works on rendered bytes"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def render(req: ChatRequest, tools: list | None) -> np.ndarray:
        # Rendered to text, then encoded: tokenize=True returns a list in transformers 4.x and
        # a BatchEncoding (a mapping, not a dict) in 5.x.
        text = tok.apply_chat_template(
            req.messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.uint32)

    return render


# ---- diagnosis ----------------------------------------------------------------------------------


@dataclass
class Finding:
    """One request that lost part of its session's prefix: where and why."""

    session: str
    line: int
    kept: int  # tokens shared with the previous request of the session
    expected: int  # tokens it could have shared (the previous request's prompt)
    cause: str
    location: str
    fix: str
    #: for volatile values: (segment label, kind, exact pattern of counters) to move at fix time
    volatile: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class Report:
    """What :func:`diagnose` found, and the hit rates before and after the automatic fixes.
    ``unit``: what the prefix lengths count, ``"bytes"`` of the rendered text, or ``"tokens"``
    with a tokenizer's renderer."""

    requests: int
    sessions: int
    findings: list[Finding]
    hit_rate_logged: float
    hit_rate_fixed: float
    unit: str = "bytes"

    def table(self) -> str:
        """The findings grouped by session, cause and location, as a text table."""
        groups: dict[tuple[str, str, str], list[Finding]] = {}
        for f in self.findings:
            groups.setdefault((f.session, f.cause, f.location.split(":")[0]), []).append(f)
        rows = [("session", "requests", "prefix kept", "cause", "location", "fix")]
        for (session, cause, _), fs in groups.items():
            kept = sum(f.kept for f in fs) / max(1, sum(f.expected for f in fs))
            first = fs[0]
            rows.append(
                (
                    _clip(session, 24),
                    str(len(fs)),
                    f"{kept:.0%} (at {first.kept:,} of {first.expected:,} {self.unit})",
                    cause,
                    _clip(first.location, 70),
                    first.fix,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = []
        for n, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
            if n == 0:
                lines.append("-" * (sum(widths) + 2 * 5 + len(r[5])))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: requests, sessions, findings and the two hit rates."""
        return (
            f"{self.requests} requests in {self.sessions} sessions; "
            f"{len(self.findings)} lost their session's prefix. "
            f"hit rate as logged {self.hit_rate_logged:.1%}, after fixes {self.hit_rate_fixed:.1%}"
        )


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _volatile_cover(text: str, lo: int, hi: int) -> tuple[str, re.Match[str]] | None:
    """The first volatile pattern with a match in ``text`` covering ``[lo, hi)`` (an empty span
    at ``lo`` counts as covered by a match around it)."""
    for kind, pat in VOLATILE:
        for m in pat.finditer(text):
            if m.start() <= lo and hi <= m.end() and m.end() > m.start():
                return kind, m
    return None


def _words(text: str, lo: int, hi: int) -> tuple[int, int]:
    """``[lo, hi)`` widened to whole words, for display."""
    while lo > 0 and text[lo - 1].isalnum():
        lo -= 1
    while hi < len(text) and text[hi].isalnum():
        hi += 1
    return lo, hi


def _counter(text: str, lo: int, hi: int) -> tuple[str, str] | None:
    """A changed number (``Turn 3`` -> ``Turn 4``): its label and a pattern for label + number."""
    a, b = lo, hi
    while a > 0 and text[a - 1].isdigit():
        a -= 1
    while b < len(text) and text[b].isdigit():
        b += 1
    if a == b or not text[a:b].isdigit():
        return None
    m = re.search(r"([A-Za-z_#][\w#-]*)\s*[:#=]?\s*$", text[max(0, a - 40) : a])
    if not m:
        return None
    label = m.group(1)
    return text[a:b], re.escape(label) + r"\s*[:#=]?\s*\d+"


def _classify_text(label: str, old: str, new: str) -> tuple[str, str, list[tuple[str, str, str]]]:
    """Cause, location and volatile kinds of a changed system prompt or message."""
    sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
    kinds: list[tuple[str, str, str]] = []
    first: str | None = None
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            continue
        hit_new = _volatile_cover(new, j1, j2)
        hit_old = _volatile_cover(old, i1, i2)
        if hit_new and hit_old and hit_new[0] == hit_old[0]:
            kind, m = hit_new
            spec = (label, kind, "")
            where = f"{label}, char {m.start()}: {hit_old[1].group(0)!r} -> {m.group(0)!r}"
        else:
            c_new, c_old = _counter(new, j1, j2), _counter(old, i1, i2)
            if not (c_new and c_old and c_new[1] == c_old[1]):
                (a1, a2), (b1, b2) = _words(old, i1, i2), _words(new, j1, j2)
                return (
                    "system prompt edited" if label == "system prompt" else "history rewritten",
                    f"{label}, char {b1}: {_clip(old[a1:a2], 24)!r} -> {_clip(new[b1:b2], 24)!r}",
                    [],
                )
            spec = (label, "counter", c_new[1])
            where = f"{label}, char {j1}: counter {c_old[0]} -> {c_new[0]}"
        if spec not in kinds:
            kinds.append(spec)
        first = first or where
    assert first is not None
    return "volatile value", first, kinds


def _compare(prev: ChatRequest, cur: ChatRequest) -> tuple[str, str, list] | None:
    """Why ``cur`` does not extend ``prev`` (cause, location, volatile specs), or None if it
    does (or is a prefix of it: a retry)."""
    a, b = _segments(prev.messages, prev.tools), _segments(cur.messages, cur.tools)
    for sa, sb in zip(a, b):
        if sa == sb:
            continue
        la, lb = sa[0], sb[0]
        if la == "tools" and lb == "tools":
            if stable_tools(prev.tools) != stable_tools(cur.tools):
                return "tools changed", "tools: the schemas differ", []
            names_a = [_tool_name(t) for t in prev.tools or []]
            names_b = [_tool_name(t) for t in cur.tools or []]
            if names_a != names_b:
                return "tool order changed", f"tools: {names_a} -> {names_b}", []
            return "tool key order changed", "tools: same schemas, keys in another order", []
        if "tools" in (la, lb):
            return "tools changed", "tools: added or removed", []
        if la != lb:
            return "history rewritten", f"{la} -> {lb}: messages removed or reordered", []
        if sa[2] == sb[2]:  # same text, another role: "system" -> "developer"
            cause = "system prompt edited" if la == "system prompt" else "history rewritten"
            return cause, f"{la}: role {sa[1]!r} -> {sb[1]!r}", []
        return _classify_text(la, sa[2], sb[2])
    return None  # cur extends prev, or is a prefix of it (a retry): served in full


def _lcp(x: np.ndarray, y: np.ndarray) -> int:
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def _hit_rate(seqs: list[np.ndarray]) -> float:
    if not seqs:
        return 0.0
    cache = radixkv.RadixCache(sum(len(s) for s in seqs) + 1, 1)
    for s in seqs:
        r = cache.admit(s)
        cache.commit(r, r.num_tokens)
        cache.finish(r)
    return cache.stats.hit_rate


def _apply_fixes(req: ChatRequest, volatile: list[tuple[str, str, str]]) -> ChatRequest:
    """The request with stable tools and the volatile values of ``volatile`` (segment label,
    kind, counter pattern) moved to the end of its last message."""
    msgs = [dict(m) for m in req.messages]
    moved: list[str] = []
    labels = {lab: i for i, (lab, _, _) in enumerate(_segments(msgs, None))}
    for label, kind, pattern in volatile:
        if label not in labels:
            continue
        idx = labels[label]  # without a tools segment, segment i is message i
        text = _text(msgs[idx].get("content"))
        pat = re.compile(pattern) if kind == "counter" else dict(VOLATILE)[kind]
        moved.extend(m.group(0) for m in pat.finditer(text))
        msgs[idx]["content"] = pat.sub("", text)
    if moved and len(msgs) > 0:
        last = msgs[-1]
        last["content"] = _text(last.get("content")) + "\n(" + "; ".join(moved) + ")"
    return ChatRequest(req.line, msgs, stable_tools(req.tools) or None, req.session)


def diagnose(
    requests: Sequence[ChatRequest],
    render: Callable[[ChatRequest, list | None], np.ndarray] | None = None,
) -> Report:
    """Finds, for each request, where it stops sharing a prefix with the previous request of
    its session and why; measures the hit rate as logged and after the automatic fixes."""
    unit = "bytes" if render is None else "tokens"
    render = render or _byte_renderer
    last: dict[str, tuple[ChatRequest, np.ndarray]] = {}
    findings: list[Finding] = []
    seqs = []
    for req in requests:
        toks = render(req, req.tools)
        seqs.append(toks)
        prev = last.get(req.session)
        last[req.session] = (req, toks)
        if prev is None:
            continue
        why = _compare(prev[0], req)
        if why is None:
            continue
        cause, location, volatile = why
        if cause == "volatile value":
            kinds = ", ".join(dict.fromkeys(k for _, k, _ in volatile))
            fix = FIXES[cause].format(what=kinds, where=volatile[0][0])
        else:
            fix = FIXES[cause]
        # Tokens it could have shared: the previous prompt without its assistant prompt.
        expected = len(prev[1])
        findings.append(
            Finding(
                req.session, req.line, _lcp(prev[1], toks), expected, cause, location, fix, volatile
            )
        )
    specs = list(dict.fromkeys(s for f in findings for s in f.volatile))
    fixed = [render(r2, r2.tools) for r2 in (_apply_fixes(r, specs) for r in requests)]
    return Report(
        requests=len(requests),
        sessions=len({r.session for r in requests}),
        findings=findings,
        hit_rate_logged=_hit_rate(seqs),
        hit_rate_fixed=_hit_rate(fixed),
        unit=unit,
    )
