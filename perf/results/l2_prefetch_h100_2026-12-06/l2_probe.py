"""Are the 0.6B's skinny matmuls at 8 rows faster with their weight in L2, and does a side-stream prefetch get them
there? Per (N, K): a CUDA graph of 32 back-to-back matmuls on the same weight (hot: it stays in L2), on 8 weights
in turn (cold: 8 x the bytes, out of L2), and cold with the next weight prefetched on a side stream a matmul ahead
(l2_prefetch.WeightPrefetcher, evict_last and normal). us per matmul, median of 20 replays."""
import statistics
import sys

import torch

sys.path.insert(0, "backends")
from tokenrouter.runner import l2_prefetch  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402

dev = torch.device("cuda", 0)
M, REPS, COPIES = 8, 32, 8
print(torch.cuda.get_device_name(0), "L2", torch.cuda.get_device_properties(0).L2_cache_size >> 20, "MiB")


def timed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / REPS)
    return statistics.median(ts)


def measure(n: int, k: int) -> dict:
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
    wsk = sg.workspace_for([(n, k)], 64, dev, torch.bfloat16, None)
    order = [ws[i % COPIES] for i in range(REPS)]

    def hot():
        for _ in range(REPS):
            sg.skinny_linear(x, ws[0], wsk)

    def cold():
        for w in order:
            sg.skinny_linear(x, w, wsk)

    row = {"hot": timed(hot), "cold": timed(cold)}
    for mode in ("last", "normal"):
        l2_prefetch.MODE = mode
        pf = l2_prefetch.WeightPrefetcher(order, dev, distance=1)

        def prefetched(pf=pf):
            pf.begin()
            for j, w in enumerate(order):
                pf.before(j)
                sg.skinny_linear(x, w, wsk)
            pf.join()

        row["pf_" + mode] = timed(prefetched)
    return row


for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
    row = measure(n, k)
    mb = n * k * 2 / 2**20
    print(f"{n}x{k} ({mb:.1f} MiB): " + ", ".join(f"{key} {v:.2f} us" for key, v in row.items()), flush=True)
