"""Debug (kept with its results): the 32B's warm-up in a process limited under MPS, every forward checked for
non-finite logits; on one, the first module with a non-finite output and an eager rerun with each attention
backend. Run from the repository root on the GPU machine: python3 perf/results/sm_share_h200_2026-12-02/nan_mps.py"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "backends"))

def bad_rows(out) -> list[int]:
    return (~out.logits.isfinite()).any(-1).nonzero().flatten().tolist()


def child(pct: int, force: int | None) -> None:
    if force:
        from tokenrouter.runner.triton_attention import TritonAttention
        TritonAttention._sm_count = lambda self, d: force
    if pct < 100:  # before this process starts CUDA (the run used a since-removed helper doing the same)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
    import torch

    from tokenrouter.config import load_config
    from tokenrouter.engine import warmup
    from tokenrouter.engine.subserver import Subserver
    from tokenrouter.runner.attention import TorchAttention
    from tokenrouter.tokenizer import load_tokenizer
    cfg = load_config(str(ROOT / "config/random/qwen3-0.6b_qwen3-32b.yaml"))
    cfg.models["large"].warmup = False
    sub = Subserver.from_config(cfg, "large", lambda e: None, load_tokenizer(cfg.tokenizer_path))
    r = sub.runner
    print(pct, "SMs", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
    ps = list(r.model.parameters())
    print(pct, "weights finite", all(bool(p.isfinite().all()) for p in ps),
          "checksum", float(ps[1].float().sum()), float(ps[5].float().abs().max()), flush=True)
    orig = r.forward
    n = [0]
    def checked(chunks):
        out = orig(chunks)
        torch.cuda.synchronize()
        n[0] += 1
        bad = (~out.logits.isfinite()).any(dim=-1)
        desc = [(c.num_new_tokens, c.seq.num_computed_tokens, c.samples) for c in chunks]
        shape = r.graphs.fits(chunks) if r.graphs is not None else None
        if bool(bad.any()):
            print(pct, f"step {n[0]}: NON-FINITE rows {bad.nonzero().flatten().tolist()} of {len(bad)}; graph {shape}; "
                  f"chunks (new, computed, samples) {desc}", flush=True)
            g = r.graphs
            r.graphs = None
            for c in chunks:
                c.seq.num_forwarded_tokens -= c.num_new_tokens
            first = []
            def hook(mod, inp, outp, i=None):
                if i is None:
                    i = [0]
                ts = outp if isinstance(outp, tuple) else (outp,)
                ins = inp if isinstance(inp, tuple) else (inp,)
                in_ok = all(bool(t.isfinite().all()) for t in ins if torch.is_tensor(t))
                ok = all(bool(t.isfinite().all()) for t in ts if torch.is_tensor(t))
                if not ok and not first:
                    first.append((mod.__class__.__name__, mod._dbg_name, "inputs finite", in_ok))
            hs = []
            for li, layer in enumerate(r.model.model.layers):
                for nm, mod in layer.named_modules():
                    mod._dbg_name = f"layer{li}.{nm}"
                    hs.append(mod.register_forward_hook(hook))
            eager = orig(chunks)
            torch.cuda.synchronize()
            for h in hs:
                h.remove()
            print(pct, "  first non-finite module output (eager triton):", first, flush=True)
            print(pct, "  eager triton: non-finite rows", bad_rows(eager), flush=True)
            ab = r.attn_backend
            r.attn_backend = TorchAttention()
            try:
                t = orig(chunks)
                torch.cuda.synchronize()
                print(pct, "  eager torch attention: non-finite rows", bad_rows(t), flush=True)
            except Exception as e:
                print(pct, "  torch attention failed", e, flush=True)
            r.attn_backend, r.graphs = ab, g
            out = orig(chunks)
        else:
            print(pct, f"step {n[0]} ok graph {shape} rows {len(bad)} tokens {sum(d[0] for d in desc)}", flush=True)
        return out
    r.forward = checked
    try:
        print(pct, "warm-up", warmup.warm_up(sub), flush=True)
    except Exception as e:
        print(pct, "warm-up FAILED", type(e).__name__, str(e)[:300], flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
        sys.exit(0)
    from tokenrouter.serving import mps
    mps.start()
    try:
        for args in (["100", "104"], ["80", "132"], ["80"]):
            print("=== percent / forced attention SMs", args, flush=True)
            subprocess.run([sys.executable, __file__, *args], timeout=150)
    finally:
        mps.stop()
