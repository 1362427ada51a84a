"""Train a small and a large Qwen3-architecture model that share one tokenizer, here, on the Python standard
library's sources (no weights or data can be downloaded): the model pair that token-level routing needs to
show anything (the large model must be clearly better than the small one).

    # one H200 (issue 15: ~1.3M and ~7.3M parameters, a few minutes each)
    python -m tokenrouter.tools.train_pair --out models/pair --device cuda
    # a CPU smoke run of the whole pipeline (tiny shapes, a few steps)
    python -m tokenrouter.tools.train_pair --out /tmp/pair --shapes smoke --steps 20 --device cpu

Data: every stdlib .py file, one document each, `<|endoftext|>` between them; every HELD_OUT_EVERY-th file
(in path order) is held out, so held-out loss is measured on files neither model (nor the tokenizer) saw;
OUT/held_out.json lists them by path and hash, and the tools that use the pair on another machine
(train_router.py, perf/routing_quality.py) read that list (`pair_split`). Tokenizer: the project's
byte-level BPE (tools/bpe.py) at --vocab-size, trained on the training files' first bytes.
Training: next-token cross-entropy on random windows of --seq-len tokens, AdamW, linear warm-up then cosine
decay, bf16 autocast on CUDA. Writes OUT/small, OUT/large (config.json, model.safetensors in bf16,
generation_config.json, the tokenizer files), OUT/tokenizer and OUT/TRAINING.json (shapes, parameter counts,
tokens seen, seconds, held-out loss of each model before and after training).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from tokenrouter.tools.bpe import SPECIAL_TOKENS, read_sources, stdlib_root, stdlib_sources, train_bpe_tokenizer
from tokenrouter.tools.chatml import ENDOFTEXT, IM_END

HELD_OUT_EVERY = 50  # every 50th stdlib file is held out (about 2 % of the corpus)
TOKENIZER_CORPUS_BYTES = 8_000_000


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    lr: float


SHAPES: dict[str, dict[str, Shape]] = {
    # ~1.3M and ~7.3M parameters at a 4,096-token vocabulary (embeddings included; 2.6 MB and 14.7 MB in bf16).
    # Sized to travel: the committed pair must fit, beside the checkout and the GPU bundle, in one device
    # call's 64 MiB, and keep the repository lean; the 5.6x gap is what routing needs (held-out loss).
    "pair": {
        "small": Shape(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384, tied=True, lr=3e-3),
        "large": Shape(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=768, tied=True,
                       lr=1.5e-3),
    },
    # The whole pipeline in seconds on a CPU (tests).
    "smoke": {
        "small": Shape(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64, tied=True, lr=3e-3),
        "large": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, tied=False, lr=3e-3),
    },
}


HELD_OUT_FILE = "held_out.json"


def split_files(files: list[pathlib.Path]) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    return train, held


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_held_out(out: pathlib.Path, held: list[pathlib.Path], root: pathlib.Path, python: str) -> None:
    """The held-out files by path relative to the stdlib and content hash: another machine's Python has
    other files at other positions, so tools run there must use this list, not their own split."""
    files = [{"path": f.relative_to(root).as_posix(), "sha256": _digest(f)} for f in held]
    (out / HELD_OUT_FILE).write_text(json.dumps({"python": python, "files": files}, indent=1) + "\n")


def pair_split(pair: pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path], str]:
    """(training files, held-out files, how they were chosen) for a pair: the held-out list it was trained
    with when it has one (files missing or changed on this machine are left out of both), else this
    machine's own split (models without one, e.g. the tiny test models)."""
    files = stdlib_sources()
    listed = pair / HELD_OUT_FILE
    if not listed.is_file():
        train, held = split_files(files)
        return train, held, f"this machine's split (every {HELD_OUT_EVERY}th stdlib file; no {HELD_OUT_FILE})"
    data = json.loads(listed.read_text())
    root = stdlib_root()
    wanted = {e["path"]: e["sha256"] for e in data["files"]}
    held = [root / p for p, h in wanted.items() if (root / p).is_file() and _digest(root / p) == h]
    train = [f for f in files if f.relative_to(root).as_posix() not in wanted]
    missing = len(wanted) - len(held)
    note = f"the pair's {HELD_OUT_FILE}: {len(held)} of {len(wanted)} files present and unchanged here"
    return train, held, note + (f" ({missing} left out)" if missing else "")


def encode(tokenizer: PreTrainedTokenizerFast, files: list[pathlib.Path], max_bytes: int | None) -> torch.Tensor:
    """The files' tokens back to back, `<|endoftext|>` after each (int32 on the CPU)."""
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    ids: list[int] = []
    texts = list(read_sources(files, max_bytes))
    for i in range(0, len(texts), 256):  # batches: the fast tokenizer encodes them on every core
        for doc in tokenizer(texts[i : i + 256], add_special_tokens=False)["input_ids"]:
            ids += doc + [eot]
    return torch.tensor(ids, dtype=torch.int32)


def model_config(shape: Shape, tokenizer: PreTrainedTokenizerFast, max_len: int) -> Qwen3Config:
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied, max_position_embeddings=max_len,
        rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=False, initializer_range=0.02,
        eos_token_id=im_end, pad_token_id=eot, bos_token_id=eot,
    )


def windows(data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq_len + 1 tokens (inputs and their next tokens), gathered on `data`'s
    device (the training tokens live there: no host copy per step)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch, 1), generator=gen).to(data.device)
    return data[starts + torch.arange(seq_len + 1, device=data.device)].long()


@torch.no_grad()
def held_out_loss(model: Qwen3ForCausalLM, data: torch.Tensor, seq_len: int, batch: int, device: torch.device,
                  max_windows: int) -> float:
    """Mean next-token loss over consecutive, non-overlapping windows of the held-out tokens."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = [data[j * seq_len : j * seq_len + seq_len + 1] for j in range(i, min(n, i + batch))]
        x = torch.stack(rows).long().to(device)
        with _autocast(device):
            logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(model: Qwen3ForCausalLM, data: torch.Tensor, steps: int, lr: float, seq_len: int, batch: int,
          device: torch.device, seed: int, log_every: int) -> int:
    """AdamW on random windows; linear warm-up over 5 % of the steps, cosine decay to 10 % of `lr`. Returns
    the number of tokens trained on."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    warm = max(1, steps // 20)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        progress = (step - warm) / max(1, steps - warm)
        scale = (step + 1) / warm if step < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x = windows(data, seq_len, batch, gen)
        with _autocast(device):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step + 1}/{steps}: loss {float(loss):.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
    return steps * batch * seq_len


def save(model: Qwen3ForCausalLM, tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    """bf16 safetensors, the generation config (stop at <|im_end|> or <|endoftext|>) and the tokenizer."""
    cfg = model.config
    model.generation_config = GenerationConfig(
        eos_token_id=[cfg.eos_token_id, cfg.pad_token_id], pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id, do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (small/, large/, tokenizer/, TRAINING.json)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="pair")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5000, help="optimizer steps per model")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-train-bytes", type=int, default=None, help="read at most this much training text")
    p.add_argument("--eval-windows", type=int, default=512, help="held-out windows of --seq-len evaluated")
    p.add_argument("--sources", type=pathlib.Path, default=None,
                   help="a copy of a standard library to train on (default: this Python's; a GPU image's may be "
                        "stripped). Name its Python version with --sources-python")
    p.add_argument("--sources-python", default=sys.version.split()[0],
                   help="the Python version --sources comes from (recorded in held_out.json)")
    p.add_argument("--extra", type=pathlib.Path, action="append", default=[],
                   help="a folder of more .py files to train on (never held out; repeatable), e.g. the sources "
                        "of installed packages: the standard library alone is a few million tokens")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "eval_windows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    min_vocab = 256 + len(SPECIAL_TOKENS)  # byte-level BPE: every byte is an id before any merge
    if args.vocab_size < min_vocab:
        p.error(f"--vocab-size must be >= {min_vocab} (256 bytes and the special tokens)")
    if args.log_every < 0:
        p.error("--log-every must be >= 0 (0: no progress lines)")
    if args.max_train_bytes is not None and args.max_train_bytes < 1:
        p.error("--max-train-bytes must be >= 1")
    # Every folder is checked before anything is written to --out.
    root = stdlib_root() if args.sources is None else args.sources
    if not root.is_dir():
        p.error(f"--sources {root}: not a folder")
    for extra in args.extra:
        if not extra.is_dir():
            p.error(f"--extra {extra}: not a folder")
    out = pathlib.Path(args.out)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: {e.strerror or e}")

    t0 = time.perf_counter()
    train_files, held_files = split_files(stdlib_sources(root))
    write_held_out(out, held_files, root, args.sources_python)
    for extra in args.extra:
        train_files += sorted(extra.rglob("*.py"))
    tokenizer = train_bpe_tokenizer(out / "tokenizer", args.vocab_size, TOKENIZER_CORPUS_BYTES, train_files)
    train_data = encode(tokenizer, train_files, args.max_train_bytes).to(device)
    held_data = encode(tokenizer, held_files, None)
    print(f"tokenizer {len(tokenizer)} ids; {len(train_data):,} training and {len(held_data):,} held-out tokens "
          f"({len(train_files)} / {len(held_files)} files), {time.perf_counter() - t0:.0f} s", flush=True)
    if len(train_data) <= args.seq_len + 1 or len(held_data) <= args.seq_len + 1:
        p.error("not enough text for --seq-len")

    report: dict[str, Any] = {
        "data": {"source": f"the Python {args.sources_python} standard library's .py files",
                 "held_out": f"every {HELD_OUT_EVERY}th file in path order",
                 "extra": [f"{e.name}: {len(list(e.rglob('*.py')))} files" for e in args.extra],
                 "train_tokens": len(train_data),
                 "held_out_tokens": len(held_data), "train_files": len(train_files), "held_out_files": len(held_files)},
        "tokenizer": {"vocab_size": len(tokenizer), "corpus_bytes": TOKENIZER_CORPUS_BYTES},
        "training": {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "seed", "device")},
        "models": {},
    }
    for k, (name, shape) in enumerate(SHAPES[args.shapes].items()):
        torch.manual_seed(args.seed + k)
        model = Qwen3ForCausalLM(model_config(shape, tokenizer, max_len=4096)).to(device)
        params = sum(p.numel() for p in model.parameters())
        before = held_out_loss(model, held_data, args.seq_len, args.batch_size, device, args.eval_windows)
        print(f"{name}: {params / 1e6:.2f}M parameters, held-out loss {before:.3f} before training", flush=True)
        t = time.perf_counter()
        tokens = train(model, train_data, args.steps, shape.lr, args.seq_len, args.batch_size, device,
                       args.seed + k, args.log_every)
        seconds = time.perf_counter() - t
        after = held_out_loss(model, held_data, args.seq_len, args.batch_size, device, args.eval_windows)
        print(f"{name}: held-out loss {after:.3f} after {tokens:,} tokens in {seconds:.0f} s", flush=True)
        save(model, out / "tokenizer", out / name)
        report["models"][name] = {"shape": asdict(shape), "parameters": params, "tokens": tokens,
                                  "seconds": round(seconds, 1), "held_out_loss_before": round(before, 4),
                                  "held_out_loss": round(after, 4)}
        del model
    (out / "TRAINING.json").write_text(json.dumps(report, indent=1) + "\n")
    small, large = (report["models"][m]["held_out_loss"] for m in ("small", "large"))
    print(f"held-out loss: small {small:.3f}, large {large:.3f} ({out / 'TRAINING.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
