"""The command line as a user meets it, run as a subprocess: every user error is one line,
``radixkv: error: ...``, with exit status 2 and no traceback; every option's help says its
default; ``radixkv replay`` and ``radixkv demo`` run without the optional tqdm and matplotlib."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from radixkv.apps import cli

pytestmark = pytest.mark.robust

#: Runs the CLI with the modules named in argv[1] (comma list, may be empty) made unimportable.
RUNNER = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None  # `import name` now raises ImportError
from radixkv.apps.cli import main
sys.exit(main(sys.argv[2:]))
"""


def radixkv(*argv: str, without: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, without, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def trace(tmp_path):
    """A radixkv trace of two requests: 40 and 8 prompt tokens, 4 output tokens each."""
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0.0, "tokens": list(range(1, 41)), "output_length": 4},
        {"timestamp": 0.1, "tokens": list(range(1, 9)), "output_length": 4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_replay_user_errors(tmp_path, trace):
    missing = tmp_path / "nope.jsonl"
    assert_user_error(radixkv("replay", str(missing)), str(missing), "does not exist")
    assert_user_error(radixkv("replay", str(tmp_path)), "is a directory")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert_user_error(radixkv("replay", str(bad)), "line 1: not JSON")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_user_error(radixkv("replay", str(empty)), "no requests in")
    for option in ("--page-size", "--num-pages", "--limit", "--token-budget", "--max-running"):
        assert_user_error(radixkv("replay", str(trace), option, "0"), option, "got 0")
    assert_user_error(radixkv("replay", str(trace), "--page-size", "x"), "--page-size", "'x'")
    assert_user_error(radixkv("replay", str(trace), "--prefill-tps", "0"), "--prefill-tps")
    assert_user_error(radixkv("replay", str(trace), "--max-wait", "-1"), "--max-wait")
    assert_user_error(radixkv("replay", str(trace), "--policy", "sjf"), "unknown policy 'sjf'")
    assert_user_error(radixkv("replay", str(trace), "--frobnicate"), "--frobnicate")
    # A pool smaller than every request: 2 pages of 4 tokens, the smallest needs 11 tokens.
    proc = radixkv("replay", str(trace), "--page-size", "4", "--num-pages", "2", "--no-chart")
    assert_user_error(proc, "cannot hold any request", "the smallest needs 11 tokens")


def test_replay_says_when_it_drops_requests(trace):
    proc = radixkv("replay", str(trace), "--page-size", "4", "--num-pages", "8", "--no-chart")
    assert proc.returncode == 0, proc.stderr
    assert "note: 1 of 2 requests need more than the pool's 32 tokens" in proc.stdout


def test_replay_runs_without_tqdm_and_matplotlib(tmp_path, trace):
    proc = radixkv("replay", str(trace), "--out", str(tmp_path), without="tqdm,matplotlib")
    assert proc.returncode == 0, proc.stderr
    assert "chart: skipped (matplotlib is not installed" in proc.stdout
    assert "hit rate" in proc.stdout and not list(tmp_path.glob("*.png"))


def test_demo_user_errors(tmp_path):
    for option in ("--page-size", "--num-pages", "--token-budget"):
        assert_user_error(radixkv("demo", "--quick", option, "0"), option, "got 0")
    assert_user_error(radixkv("demo", "--threads", "-1"), "--threads")
    missing = tmp_path / "ckpt"
    assert_user_error(radixkv("demo", "--quick", "--checkpoint", str(missing)), "does not exist")


def test_demo_checkpoint_and_device_errors(tmp_path, capsys):
    """In-process (torch is loaded already): the same one line and exit status."""

    def user_error(*argv: str, needles: tuple[str, ...]) -> None:
        assert cli.main(["demo", "--quick", "--out", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("radixkv: error: demo: "), err
        assert all(n in err[0] for n in needles), err

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    user_error("--checkpoint", str(ckpt), needles=("cannot be loaded", "config.json"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    user_error("--checkpoint", str(ckpt), needles=("cannot be loaded", "gpt2"))
    (ckpt / "config.json").write_text("{not json")
    user_error("--checkpoint", str(ckpt), needles=("cannot be loaded",))
    user_error("--device", "nonsense-device", needles=("--device",))


def test_demo_runs_without_tqdm_and_matplotlib(tmp_path):
    pytest.importorskip("torch")  # the demo runs a torch model (its subprocess needs torch)
    proc = radixkv("demo", "--quick", "--random", "--out", str(tmp_path), without="tqdm,matplotlib")
    assert proc.returncode == 0, proc.stderr
    assert "identical with and without caching: yes" in proc.stdout
    assert "chart: skipped (matplotlib is not installed" in proc.stdout


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_option_says_what_it_does_and_its_default(command):
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    for action in sub.choices[command]._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and len(action.help) > 15, action.option_strings
        assert "default" in action.help, (command, action.option_strings, action.help)
    proc = radixkv(command, "--help")
    assert proc.returncode == 0 and "default" in proc.stdout


# ---- radixkv doctor ---------------------------------------------------------------------------


def chat_log(path, systems):
    """A log of one session, one request per system prompt in ``systems``."""
    rows = [
        {"session": "s", "messages": [{"role": "system", "content": sp}, *history]}
        for sp, history in zip(systems, ([{"role": "user", "content": "fix the test"}],) * 99)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_doctor_user_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert_user_error(radixkv("doctor", str(missing)), "doctor: ", str(missing), "does not exist")
    assert_user_error(radixkv("doctor", str(tmp_path)), "is a directory")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert_user_error(radixkv("doctor", str(empty)), "no requests in", str(empty))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe{}\n")
    assert_user_error(radixkv("doctor", str(binary)), "cannot read requests file", "utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    assert_user_error(radixkv("doctor", str(bad)), "line 2: not JSON")
    log = chat_log(tmp_path / "log.jsonl", ["You are terse."] * 2)
    no_dir = tmp_path / "no-tokenizer"
    assert_user_error(
        radixkv("doctor", str(log), "--tokenizer", str(no_dir)), "--tokenizer", "does not exist"
    )
    no_dir.mkdir()
    assert_user_error(
        radixkv("doctor", str(log), "--tokenizer", str(no_dir), without="transformers"),
        "--tokenizer needs the transformers package",
    )
    # The real entry point (python -m radixkv) gives the same one line and status.
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv", "doctor", str(missing)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_user_error(proc, "does not exist")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_doctor_unreadable_file(tmp_path):
    log = chat_log(tmp_path / "log.jsonl", ["You are terse."] * 2)
    log.chmod(0)
    try:
        assert_user_error(radixkv("doctor", str(log)), "cannot read requests file", "ermission")
    finally:
        log.chmod(0o600)


def test_doctor_findings_exit_1_and_are_no_error(tmp_path):
    """Findings are a result: printed on stdout, exit status 1, nothing on stderr; a clean log
    exits 0. --help says so."""
    clean = chat_log(tmp_path / "clean.jsonl", ["You are terse. " * 20] * 3)
    proc = radixkv("doctor", str(clean))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "no cache-breaking prompts found" in proc.stdout
    drifting = chat_log(
        tmp_path / "drift.jsonl", [f"Current time: 2025-03-01T10:{m:02d}:07Z\n" * 3 for m in (1, 2)]
    )
    proc = radixkv("doctor", str(drifting))
    assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr
    assert "volatile value" in proc.stdout
    proc = radixkv("doctor", "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    assert "1 when it finds something (a result, not an error)" in text
    assert "2 for a user error" in text


# ---- --metrics-port ---------------------------------------------------------------------------


def test_metrics_port_user_errors(trace):
    pytest.importorskip("prometheus_client")
    for port in ("-1", "65536", "http"):
        assert_user_error(
            radixkv("replay", str(trace), "--no-chart", "--metrics-port", port),
            "--metrics-port",
            "must be a port number in [0, 65535]",
            port,
        )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = radixkv("replay", str(trace), "--no-chart", "--metrics-port", port)
    assert_user_error(proc, "replay: cannot serve metrics", f"--metrics-port {port}", "in use")
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is never an address of this machine.
    proc = radixkv(
        "replay", str(trace), "--no-chart", "--metrics-port", "0", "--metrics-addr", "192.0.2.1"
    )
    assert_user_error(proc, "cannot serve metrics", "--metrics-addr '192.0.2.1'")
    proc = radixkv(
        "replay", str(trace), "--no-chart", "--metrics-port", "0", without="prometheus_client"
    )
    assert_user_error(proc, "--metrics-port", "needs prometheus_client", "radixkv[metrics]")


# ---- what every subcommand shares -------------------------------------------------------------


def one_error_line(capsys) -> str:
    """The one line an in-process ``cli.main`` printed on stderr (nothing on stdout)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: error: "), captured.err
    assert captured.out == "", captured.out  # nothing ran before the error
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["doctor", "a", "b"],
            "error: doctor: unrecognized arguments: b (see radixkv doctor --help)",
        ),
        (
            ["demo", "--bogus"],
            "error: demo: unrecognized arguments: --bogus (see radixkv demo --help)",
        ),
        (
            ["replay", "t.jsonl", "--page-size", "0"],
            "error: replay: argument --page-size: must be an int >= 1, got 0 "
            "(see radixkv replay --help)",
        ),
        (["bogus"], "error: argument COMMAND: invalid choice: 'bogus'"),
    ],
    ids=["extra-argument", "unknown-option", "bad-value", "unknown-command"],
)
def test_argparse_errors_name_the_subcommand_once_and_its_own_help(capsys, argv, want):
    assert cli.main(argv) == 2
    line = one_error_line(capsys)
    assert want in line and line.count("radixkv:") == 1, line
    if argv[0] == "bogus":
        assert line.endswith("(see radixkv --help)")


def test_unknown_choices_are_listed_as_words(trace, capsys):
    assert cli.main(["replay", str(trace), "--policy", "xyz", "--no-chart"]) == 2
    line = one_error_line(capsys)
    assert "unknown policy 'xyz' (choose from fcfs, lpm, dfs-weight" in line and "('" not in line
    assert cli.main(["replay", str(trace), "--replicas", "2", "--router", "zz", "--no-chart"]) == 2
    line = one_error_line(capsys)
    assert "choose from round-robin, prefix, least-loaded" in line and "('" not in line


@pytest.mark.parametrize("command", ["replay", "demo"])
def test_a_bad_out_is_refused_before_the_work_starts(tmp_path, trace, capsys, command):
    """An --out that is a file, under a file, or where nothing can be created: one line and
    exit status 2 before anything is replayed or any model is loaded (stdout stays empty)."""
    pytest.importorskip("matplotlib")  # without it no chart is written, and --out is not used
    if command == "demo":
        pytest.importorskip("torch")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad = {str(a_file): "is not a directory", str(a_file / "sub"): "cannot be created"}
    if os.path.isdir("/proc"):
        bad["/proc/radixkv-out"] = "cannot be created"
    argv = [str(trace), "--policy", "lpm"] if command == "replay" else ["--quick", "--random"]
    for out, why in bad.items():
        assert cli.main([command, *argv, "--out", out]) == 2, out
        line = one_error_line(capsys)
        assert line.startswith(f"radixkv: error: {command}: --out {out!r}") and why in line, line


def test_keep_serving_needs_a_metrics_port(trace, capsys):
    assert cli.main(["replay", str(trace), "--no-chart", "--keep-serving"]) == 2
    assert "replay: --keep-serving needs --metrics-port" in one_error_line(capsys)


def test_progress_bars_only_on_a_terminal(trace):
    """A log or a pipe gets no tqdm frames; a terminal gets its bar."""
    pytest.importorskip("tqdm")
    import contextlib
    import io

    from radixkv.apps.common.args import progress_bar

    proc = radixkv("replay", str(trace), "--no-chart")  # stderr is a pipe
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "hit rate" in proc.stdout

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        with contextlib.redirect_stderr(stream):
            with progress_bar(total=3, desc="bar") as bar:
                bar.update(3)
        assert ("3/3" in stream.getvalue()) == shown, stream.getvalue()
