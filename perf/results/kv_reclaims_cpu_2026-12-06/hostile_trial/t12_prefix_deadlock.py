"""Repro: both pools 4096 (trial_d3.yaml); 12 prompts of ~3,093 tokens sharing a 3,000-token preamble, 32 tokens out,
all at once; 60 s client timeout. Reports which requests never got a final response and the KV/held gauges."""
import asyncio

import h


async def main():
    pre = h.mkprompt(3000, "SHARED2")
    prompts = [pre + h.mkprompt(100, f"F{i}") for i in range(12)]
    async with h.session() as s:
        task = asyncio.gather(*(h.stream(s, p, 32, timeout=60, name=f"P{i}") for i, p in enumerate(prompts)))
        await asyncio.sleep(30)
        keys = ("used", "held", "recl", "preem")
        print("at 30s:", h.short({k: v for k, v in h.metrics().items() if any(w in k for w in keys)}))
        rs = await task
    print(h.summarize(rs))
    print("after disconnect:", h.short(await h.wait_idle(20)))
    async with h.session() as s:
        print(h.summarize([await h.stream(s, "def after():\n", 8, timeout=60, name="after")]))
asyncio.run(main())
