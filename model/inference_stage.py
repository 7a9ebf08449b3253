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

from configs.schema import Config, config_from_dict
from model.checkpoint import has_checkpoint
from model.data import file_sha256
from model.generate import DecodeClock, check_seed, compile_programs, generate
from model.hf_gpt2 import started_from
from model.program_cache import ProgramCache
from model.quant_checkpoint import (
    QUANT_FILE,
    has_quantized_checkpoint,
    load_float_model,
    load_quantized_model,
)
from tokenizer import load_tokenizer
from tokenizer.errors import UsageError
from tokenizer.stage import TOKENIZER_FILE

SAMPLE_RULE = "---------------"


def load_trained(run_dir: Path, cache: ProgramCache | None = None):
    """(tokenizer, model, saved config) of a run directory's latest checkpoint, or of its
    quantized checkpoint (dequantized to float32) when it holds one. A `cache` keeps the
    abstract model that the weights are restored into."""
    run_dir = Path(run_dir)
    tok_path = run_dir / TOKENIZER_FILE
    quantized = has_quantized_checkpoint(run_dir)
    if not (quantized or has_checkpoint(run_dir)):
        raise UsageError(
            f"no checkpoint in {run_dir}: train first (python tinyllm.py --train ...) or point "
            "--out at a trained run directory"
        )
    if not tok_path.is_file():
        raise UsageError(f"no tokenizer in {run_dir}: the run directory is incomplete")
    tokenizer = load_tokenizer(tok_path)
    model, meta = (load_quantized_model if quantized else load_float_model)(run_dir, cache)
    if meta.get("tokenizer_sha256") != file_sha256(tok_path):
        raise UsageError(
            f"the tokenizer in {run_dir} is not the one {QUANT_FILE} was made with: "
            "quantize the trained run again"
            if quantized
            else f"the tokenizer in {run_dir} changed since the model was trained: retrain it"
        )
    return tokenizer, model, config_from_dict(meta["config"])


def check_text(prompt: str) -> None:
    """Refuse a prompt that is not valid Unicode text: bytes that were not UTF-8 reach Python
    (command line, stdin) as lone surrogates, which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = prompt[err.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        offset = len(prompt[: err.start].encode("utf-8", "surrogateescape"))
        raise UsageError(
            f"the prompt is not valid UTF-8 ({what} at byte {offset}): pass the prompt as UTF-8 "
            "text"
        ) from None


def encode_prompt(tokenizer, prompt: str, block_size: int) -> list[int]:
    """Token ids of a prompt; an empty one is the end-of-text token when the tokenizer has it."""
    check_text(prompt)
    ids = tokenizer.encode(prompt)
    if not ids:
        eot = stop_token_of(tokenizer)
        if eot is None:
            raise UsageError("the prompt is empty: give some text with --prompt")
        ids = [eot]
    if len(ids) > block_size:
        raise UsageError(
            f"the prompt is {len(ids)} tokens, longer than the model's context of {block_size} "
            "tokens: shorten it"
        )
    return ids


def stop_token_of(tokenizer) -> int | None:
    eot = "<|endoftext|>"
    if eot in getattr(tokenizer, "special_tokens", ()):
        return tokenizer.token_to_id(eot)
    return None


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
    check_seed(s.seed)
    if s.prompt is not None:
        check_text(s.prompt)
    if cfg.init_from and not started_from(run_dir, cfg.init_from):
        from model.hf_gpt2 import load_gpt2

        tokenizer, model = load_gpt2(cfg.init_from, cfg.model)  # GPT-2 itself, not a run
    else:
        tokenizer, model, _ = load_trained(run_dir, program_cache)
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


def prompt_loop(cfg: Config, tokenizer, model, programs, out: TextIO, stdin: TextIO) -> int:
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


def answer(cfg, tokenizer, model, programs, prompt, out, started, what) -> dict:
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


def timing_line(clock: DecodeClock, prompt_tokens: int, samples: int, cache: bool, what: str):
    """`inference: 6 prompt tokens, 300 new tokens; first token after 2.41 s (load + compile
    + prefill); decode 2,950 tokens/s (KV cache)`; never a rate it could not measure."""
    per = f" in {samples} samples" if samples > 1 else ""
    mode = "KV cache" if cache else "no cache"
    rate = clock.tokens_per_s
    if rate is None:
        decode = f"decode speed not measured: too few tokens after the first ({mode})"
    else:
        decode = f"decode {rate:,.0f} tokens/s ({mode})"
    first = clock.first_token_s
    return (
        f"inference: {prompt_tokens} prompt tokens, {clock.new_tokens} new tokens{per}; "
        f"first token after {first:.2f} s ({what}); {decode}"
    )
