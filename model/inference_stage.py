"""The --inference stage: tokenizer + latest checkpoint -> text streamed to stdout.

With one sample, text is printed as it is generated (a first token, then chunks of a few
tokens from the compiled decode loop, decoded incrementally so a multi-byte character split
across tokens prints once complete). With several samples, each is printed when done,
separated by a rule, as nanoGPT's sample.py does. After each answer a timing line goes to
stderr: time to the first token (for the first prompt: load + compile + prefill, from the
start of the stage) and the decode rate of the tokens after it.

With a prompt (`--prompt` or `sample.prompt`), the stage answers it and ends. Without one, or
with `interactive`, it loads the model once and answers prompts read from stdin, one per line,
until end of input; on a terminal it shows a `> ` prompt on stderr, through a pipe nothing but
the answers. An empty line samples from the end-of-text token (as an empty --prompt does).
"""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from configs.schema import Config
from model.decoding.clock import DecodeClock, timing_line
from model.decoding.generate import generate
from model.decoding.program_cache import ProgramCache
from model.decoding.programs import DecodePrograms, compile_programs
from model.decoding.prompts import check_text, encode_prompt, stop_token_of
from model.network.gpt import GPT
from model.rundir.trained import load_for_sampling
from plumbing.collector import start_up_done
from plumbing.errors import UsageError
from tokenizer import Tokenizer

SAMPLE_RULE = "---------------"


def run_inference(
    cfg: Config,
    run_dir: Path,
    *,
    interactive: bool = False,
    out: TextIO | None = None,
    stdin: TextIO | None = None,
    program_cache: ProgramCache | None = None,
) -> int:
    """Answer `cfg.sample.prompt`, or, without one or with `interactive`, every prompt read
    from stdin. Returns the exit code: 0, or 2 when a prompt read from stdin was refused.
    `program_cache` keeps what loading and compiling build, for the next run."""
    started = time.perf_counter()
    out = out or sys.stdout
    s = cfg.sample
    if s.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be positive, got {s.max_new_tokens}")
    if s.prompt is not None:
        check_text(s.prompt)
    tokenizer, model = load_for_sampling(run_dir, cfg.init_from, cfg.model, program_cache)
    start_up_done()  # the collector leaves start-up's objects alone from here
    if s.prompt is not None:
        encode_prompt(tokenizer, s.prompt, model.cfg.block_size)  # refuse it before compiling
    # Compile everything before the first token, and in the loop before the first prompt is
    # read, so each answer's first-token time is its own.
    programs = compile_programs(
        model, num_samples=s.num_samples, use_cache=s.kv_cache, cache=program_cache
    )
    if s.prompt is not None:
        answer(cfg, tokenizer, model, programs, s.prompt, out, started, "load + compile + prefill")
        if not interactive:
            return 0
    else:
        sys.stderr.write(
            f"inference: ready after {time.perf_counter() - started:.2f} s (load + compile); "
            "reading prompts from stdin, one per line\n"
        )
    return prompt_loop(cfg, tokenizer, model, programs, out, stdin or sys.stdin)


def prompt_loop(
    cfg: Config,
    tokenizer: Tokenizer,
    model: GPT,
    programs: DecodePrograms,
    out: TextIO,
    stdin: TextIO,
) -> int:
    """Answer each line of stdin until end of input; a refused prompt prints one error line
    and the loop goes on. Returns 0, or 2 if any prompt was refused."""
    terminal = stdin.isatty()
    code = 0
    try:
        for line in _lines(stdin, terminal):
            try:
                answer(cfg, tokenizer, model, programs, line, out, time.perf_counter(), "prefill")
            except UsageError as err:
                sys.stderr.write(f"tinyllm: error: {err}\n")
                code = 2
    except KeyboardInterrupt:
        if terminal:
            sys.stderr.write("\n")  # end the "> " line or the answer cut short
        raise
    return code


def _lines(stdin, terminal: bool) -> Iterator[str]:
    """Prompts from stdin without their line ends; bytes that are not UTF-8 stay in the string
    as surrogates (check_text refuses them with the prompt's own error)."""
    binary = getattr(stdin, "buffer", None)
    while True:
        if terminal:
            sys.stderr.write("> ")
            sys.stderr.flush()
        raw = binary.readline() if binary is not None else stdin.readline()
        if not raw:
            if terminal:
                sys.stderr.write("\n")
            return
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "surrogateescape")
        yield raw.removesuffix("\n").removesuffix("\r")


def answer(
    cfg: Config,
    tokenizer: Tokenizer,
    model: GPT,
    programs: DecodePrograms,
    prompt: str,
    out: TextIO,
    started: float,
    what: str,
) -> dict:
    """Stream the answer to one prompt to `out`, then its timing line to stderr."""
    s = cfg.sample
    prompt_ids = encode_prompt(tokenizer, prompt, model.cfg.block_size)
    stream = generate(
        model,
        prompt_ids,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        num_samples=s.num_samples,
        use_cache=s.kv_cache,
        stop_token=stop_token_of(tokenizer),
        programs=programs,
    )
    clock = DecodeClock(start=started)
    samples = [[] for _ in range(s.num_samples)]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if s.num_samples == 1:
        out.write(prompt)
        out.flush()
    for chunk in stream:
        clock.tick(chunk)
        for row, ids in zip(samples, chunk.tolist(), strict=True):
            row.extend(i for i in ids if i >= 0)  # a stopped sample pads with PAD_ID (-1)
        if s.num_samples == 1:
            out.write(decoder.decode(tokenizer.decode_bytes(chunk[0].tolist())))
            out.flush()
    if s.num_samples == 1:
        out.write(decoder.decode(b"", final=True) + "\n")
    else:
        for ids in samples:
            out.write(prompt + tokenizer.decode(ids) + f"\n{SAMPLE_RULE}\n")
    out.flush()
    sys.stderr.write(timing_line(clock, len(prompt_ids), s.num_samples, s.kv_cache, what) + "\n")
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": clock.new_tokens,
        "first_token_s": clock.first_token_s,
        "decode_tokens_per_sec": clock.tokens_per_s,
    }
