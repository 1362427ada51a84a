"""`tokenrouter` command line: make-tiny, make-bench-tokenizer, stub-env, serve, openai, generate."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _make_tiny(args: argparse.Namespace) -> int:
    from tokenrouter.tools.make_tiny import make_tiny

    paths = make_tiny(args.out, seed=args.seed, force=args.force)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _make_bench_tokenizer(args: argparse.Namespace) -> int:
    from tokenrouter.tools.bench_tokenizer import make_bench_tokenizer

    try:
        path = make_bench_tokenizer(args.out, args.vocab_size, args.special_start, force=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"bench tokenizer ({args.vocab_size} ids): {path}")
    return 0


# `generate`'s flags by the SamplingParams field each one sets.
_FLAGS = {"max_new_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
          "seed": "--seed", "stop": "--stop"}


def _generate(args: argparse.Namespace) -> int:
    from tokenrouter import Engine, SamplingParams
    from tokenrouter.config import load_config
    from tokenrouter.sampling_params import SamplingParamsError

    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()  # before the models load
    except SamplingParamsError as e:  # named by the flag that set it
        print(f"error: {_FLAGS.get(e.field, e.field)} {e.rule}, got {e.shown}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        config.check_devices()
        engine = Engine.from_config(config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with engine:
        prompts = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                print("error: --chat needs a tokenizer with a chat template", file=sys.stderr)
                return 2
            prompts = [
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        start = time.perf_counter()
        try:
            outputs = engine.generate(prompts, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"### prompt: {prompt!r}")
        print(out.text)
        print(f"### {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"### {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenrouter.serving.server import serve_main

    return serve_main(args)


def _stub_env(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenrouter.serving.stub_env import make

    print(f"stub environment: {make(Path(args.out), args.find_links)}")
    return 0


def _perf_analyzer(args: argparse.Namespace) -> int:
    from tokenrouter.serving.triton_install import perf_analyzer_main

    return perf_analyzer_main(args.args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenrouter", description="Token-level LLM routing engine.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("make-tiny", help="build the tiny local tokenizer and small/medium/large models")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="rebuild even if a complete set exists")
    t.set_defaults(func=_make_tiny)

    b = sub.add_parser(
        "make-bench-tokenizer",
        help="build the benchmark tokenizer for dummy-weight deployments (every id decodes to its own piece)",
    )
    b.add_argument("--out", default="models/bench-tokenizer", help="output directory (default: %(default)s)")
    b.add_argument("--vocab-size", type=int, default=151936, help="the model's vocab_size (default: Qwen3's)")
    b.add_argument(
        "--special-start",
        type=int,
        default=None,
        help="id of <|endoftext|> (<|im_start|>, <|im_end|> follow); default: Qwen3's 151643 if it fits, else 0",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if a complete one exists")
    b.set_defaults(func=_make_bench_tokenizer)

    e = sub.add_parser("stub-env", help="a venv for the Triton stubs: numpy<2 layered over this environment")
    e.add_argument("--out", default=".cache/stub-env", help="output directory (default: %(default)s)")
    e.add_argument("--find-links", help="install numpy from wheels in this folder only (no package index)")
    e.set_defaults(func=_stub_env)

    s = sub.add_parser("serve", help="serve a deployment with tritonserver (HTTP/gRPC/metrics)")
    from tokenrouter.serving.server import add_arguments

    add_arguments(s)
    s.set_defaults(func=_serve)

    o = sub.add_parser("openai", help="OpenAI-compatible HTTP frontend talking to a running server over gRPC")
    from tokenrouter.serving.openai import build_arg_parser, run_from_args

    build_arg_parser(o)
    o.set_defaults(func=run_from_args)

    # Every argument after `perf-analyzer` is perf_analyzer's own: no prefix character, so argparse parses none.
    pa = sub.add_parser(
        "perf-analyzer", add_help=False, prefix_chars="\0",
        help="tritonclient's perf_analyzer with the libraries it loads made findable (arguments pass through)",
    )
    pa.add_argument("args", nargs=argparse.REMAINDER)
    pa.set_defaults(func=_perf_analyzer)

    g = sub.add_parser("generate", help="run prompts through the in-process engine (no server)")
    g.add_argument("--config", required=True, help="deployment YAML")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    from tokenrouter.config import ConfigError, read_config_file

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if getattr(args, "config", None) is not None:
            # A subcommand's --config is a deployment YAML: a missing, unreadable or malformed one is one
            # line here, before the subcommand builds or starts anything.
            read_config_file(args.config)
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
