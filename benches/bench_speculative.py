"""bench_speculative: decode speed with and without speculative decoding, in one run, on the real
model (SmolLM2-135M-Instruct, float32, CPU), on three agent turns.

    .venv/bin/python benches/bench_speculative.py [--quick] [--threads K] [--repeats R] [--tokens N]
                                                  [--clock wall|cpu]

1. A code edit: the reply copies a file from the prompt with one change (prompt lookup,
   ``"ngram"``, drafts from the prompt; ``"suffix"`` too).
2. A retried turn: a turn sent again (a client's retry, a sibling sample): ``"suffix"`` drafts
   the reply the cache holds after the same prompt.
3. Free text: a reply that copies nothing (``"suffix"``): speculation should cost nothing.

Each turn is one greedy request (``stop`` at the model's end of sequence); its prefill step and
first token are not timed, then decode tokens/s = tokens after the first / seconds. Plain and
speculative runs alternate, ``--repeats`` times each, medians printed with their ratio, the
accepted draft tokens per step that carried a draft, the share of drafted tokens accepted, and the
decode steps (forward passes) each took, which no other load on the machine changes.
The outputs of the two are asserted equal. Benchmarks are not tests: nothing asserts a time.
Skipped (exit 0) without the real model or transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

try:
    import torch

    import radixkv
    import radixkv.hf
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path
except ImportError as e:  # an install without the [hf] extra: nothing to measure
    print(f"bench_speculative: skipped ({e}); pip install 'radixkv[hf]'")
    sys.exit(0)

from common import table

FILE = '''def load_config(path):
    """Reads the configuration file at path."""
    with open(path) as f:
        text = f.read()
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    """Writes config to the file at path."""
    with open(path, "w") as f:
        for key, value in sorted(config.items()):
            f.write(f"{key} = {value}\\n")
'''

TURNS = {
    "code edit": (
        "ngram",
        "Here is config.py:\n\n" + FILE + "\nRename the function load_config to read_config. "
        "Reply with the whole new file only.",
    ),
    "code edit (suffix)": (
        "suffix",
        "Here is config.py:\n\n" + FILE + "\nRename the function load_config to read_config. "
        "Reply with the whole new file only.",
    ),
    "retried turn": ("suffix", "Explain in a few sentences what a prefix cache for LLMs does."),
    "free text": ("suffix", "Write a short story about a cat who learns to sail."),
}


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


#: What the decode time is read from: ``wall`` (time.perf_counter) or ``cpu`` (this process's
#: CPU time, steadier on a machine others share; with one torch thread it is the step's work).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def decode(model, tok, prompt, n: int, method: str | None, retried: bool):
    """``(output, decode tokens/s, engine stats)`` of one greedy request; ``retried``: the same
    request ran to the end on this engine first (untimed)."""
    spec = None if method is None else {"method": method, "num_speculative_tokens": 8}
    eng = radixkv.hf.engine(model, radixkv.RadixCache(8192), tokenizer=tok, speculative=spec)
    if retried:
        eng.generate([prompt], max_new_tokens=n, release=True)
    st = eng.stats
    before = (st.spec_drafts, st.spec_accepted_tokens, st.spec_draft_tokens, st.steps)
    seq_id = eng.submit(prompt, n)
    while not eng.result(seq_id).output:  # the prefill and the first token, untimed
        eng.step()
    t = clock()
    while eng.has_work:
        eng.step()
    dt = clock() - t
    r = eng.result(seq_id)
    after = (st.spec_drafts, st.spec_accepted_tokens, st.spec_draft_tokens, st.steps)
    return r.output, (len(r.output) - 1) / dt, tuple(a - b for a, b in zip(after, before))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, medians (default 3)")
    ap.add_argument("--tokens", type=int, default=160, help="tokens per turn at most (160)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (steadier on a shared machine; use it with "
        "--threads 1) (default: wall)",
    )
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if smollm2_path() is None:
        print(f"bench_speculative: skipped: the real model is not installed: {SMOLLM2_INSTALL}")
        return
    torch.set_num_threads(args.threads)
    model, tok = radixkv.hf.load("smollm2")
    n, repeats = (8, 1) if args.quick else (args.tokens, args.repeats)
    turns = {k: TURNS[k] for k in ("code edit", "retried turn")} if args.quick else TURNS
    print(
        f"Greedy decode, up to {n} tokens, {repeats} runs each (medians), "
        f"num_speculative_tokens=8, {args.threads} torch threads, {args.clock} clock"
    )
    rows = []
    for name, (method, text) in turns.items():
        prompt = chat(tok, text)
        retried = name == "retried turn"
        plain, spec, stats, base = [], [], (0, 0, 0, 0), (0, 0, 0, 0)
        for _ in range(repeats):
            out_p, rate_p, base = decode(model, tok, prompt, n, None, retried)
            out_s, rate_s, stats = decode(model, tok, prompt, n, method, retried)
            assert out_s == out_p, f"{name}: speculative output differs from plain decoding"
            plain.append(rate_p)
            spec.append(rate_s)
        p, s = statistics.median(plain), statistics.median(spec)
        drafts, accepted, drafted, steps = stats
        rows.append(
            [
                name,
                method,
                str(len(out_p)),
                f"{base[3]} / {steps}",
                f"{p:.1f}",
                f"{s:.1f}",
                f"{s / p:.2f}x",
                f"{accepted / drafts:.2f}" if drafts else "-",
                f"{accepted / drafted:.0%}" if drafted else "-",
            ]
        )
    table(
        [
            "turn",
            "method",
            "tokens",
            "steps plain / spec",
            "plain tok/s",
            "spec tok/s",
            "spec / plain",
            "accepted/draft",
            "accepted %",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
