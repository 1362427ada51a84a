"""`tokenrouter` command line: make-tiny, generate."""

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


def _generate(args: argparse.Namespace) -> int:
    from tokenrouter import ConfigError, Engine, SamplingParams

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
        engine = Engine.from_config(args.config)
    except (ConfigError, FileNotFoundError) as e:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenrouter", description="Token-level LLM routing engine.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("make-tiny", help="build the tiny local tokenizer and small/medium/large models")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="rebuild even if a complete set exists")
    t.set_defaults(func=_make_tiny)

    s = sub.add_parser("serve", help="install Triton if needed and serve a deployment (HTTP/gRPC/metrics)")
    from tokenrouter.serving.server import add_arguments

    add_arguments(s)
    s.set_defaults(func=_serve)

    o = sub.add_parser("openai", help="OpenAI-compatible HTTP frontend talking to a running server over gRPC")
    from tokenrouter.serving.openai import build_arg_parser, run_from_args

    build_arg_parser(o)
    o.set_defaults(func=run_from_args)

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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
