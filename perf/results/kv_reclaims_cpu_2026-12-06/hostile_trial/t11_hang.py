"""No request_timeout_s: a request that grows past the large pool while on the small model (1500-token prompt,
1000 max_tokens, large pool 2048). Client gives up after 90 s; meanwhile 2 shorts (60 s client timeout). Then
close the stuck stream and see whether KV frees and the server serves."""
import asyncio

import h


async def main():
    async with h.session() as s:
        stuck = asyncio.create_task(h.stream(s, h.mkprompt(1500, "HANG"), 1000, timeout=90, name="stuck"))
        await asyncio.sleep(15)
        gauges = {k: v for k, v in h.metrics().items() if 'used' in k or 'held' in k or 'preempt' in k}
        print("at 15s:", h.short(gauges))
        rs = await asyncio.gather(*(h.stream(s, f"def q{i}():\n", 8, timeout=60, name=f"short{i}") for i in range(2)))
        print(h.summarize(rs))
        r = await stuck
        print(h.summarize([r]))
    print("after client gave up:", h.short(await h.wait_idle(20)))
    async with h.session() as s:
        print(h.summarize([await h.stream(s, "def after():\n", 8, timeout=60, name="after")]))
asyncio.run(main())
