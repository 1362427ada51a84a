"""Trial harness: prompts of a given token length, streaming HTTP clients with cancel, metrics scrape."""
from __future__ import annotations

import asyncio
import json
import os
import re
import time

import aiohttp
from tokenizers import Tokenizer

HTTP = os.environ.get("HTTP", "http://127.0.0.1:8100")
METRICS = os.environ.get("METRICS", "http://127.0.0.1:8102/metrics")
TOK = Tokenizer.from_file("/tmp/trial_kv/models/pair/tokenizer/tokenizer.json")


def ntok(s: str) -> int:
    return len(TOK.encode(s).ids)


def mkprompt(tokens: int, tag: str, preamble: str = "") -> str:
    """About `tokens` tokens of Python-like text unique to `tag` (after `preamble`)."""
    s = preamble + f"# file {tag}\n"
    j = 0
    lines = []
    while True:
        lines.append(f"v{tag}_{j} = {j}\n")
        j += 1
        if j % 20 == 0 and ntok(s + "".join(lines)) >= tokens:
            break
    out = s + "".join(lines)
    while ntok(out) > tokens and lines:
        lines.pop()
        out = s + "".join(lines)
    return out + "def main():\n"


def metrics_text() -> str:
    import urllib.request
    return urllib.request.urlopen(METRICS, timeout=10).read().decode()


def metrics(names=("tokenrouter_kv_blocks_used", "tokenrouter_kv_reclaims_total", "tokenrouter_preemptions_total",
                   "tokenrouter_kv_budget_tokens", "tokenrouter_requests_held", "tokenrouter_requests_finished_total",
                   "tokenrouter_kv_blocks_total")) -> dict[str, float]:
    out = {}
    for line in metrics_text().splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"(\w+)(\{[^}]*\})? (\S+)", line)
        if m and m[1] in names:
            out[m[1].removeprefix("tokenrouter_") + (m[2] or "")] = float(m[3])
    return out


def short(d: dict) -> str:
    return " ".join(f"{k.replace('model=', '').replace(',finish_reason=', ':')}={v:g}" for k, v in sorted(d.items()))


async def stream(session: aiohttp.ClientSession, prompt: str, max_tokens: int = 48, timeout: float = 300,
                 cancel_after_s: float | None = None, cancel_after_events: int | None = None, name: str = "",
                 extra: dict | None = None) -> dict:
    """One HTTP generate_stream request. Result: events, finals (events with finish_reason), errors, text, time."""
    body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})}
    if extra:
        body.update(extra)
    r = {"name": name, "events": 0, "finals": 0, "errors": [], "text": "", "finish": None, "status": None,
         "first_s": None}
    t0 = time.perf_counter()

    async def go():
        async with session.post(f"{HTTP}/v2/models/tokenrouter/generate_stream", json=body) as resp:
            r["status"] = resp.status
            if resp.status != 200:
                r["errors"].append((await resp.text())[:300])
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                ev = json.loads(line[5:])
                r["events"] += 1
                if r["first_s"] is None:
                    r["first_s"] = time.perf_counter() - t0
                if "error" in ev:
                    r["errors"].append(str(ev["error"])[:300])
                r["text"] += str(ev.get("text_output", ""))
                fr = ev.get("finish_reason")
                if fr not in (None, "", [], [""]):
                    r["finals"] += 1
                    r["finish"] = fr
                if cancel_after_events is not None and r["events"] >= cancel_after_events:
                    r["cancelled"] = True
                    return  # leaving the context closes the connection

    try:
        if cancel_after_s is not None:
            try:
                await asyncio.wait_for(go(), cancel_after_s)
            except asyncio.TimeoutError:
                r["cancelled"] = True
        else:
            await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        r["errors"].append(f"CLIENT TIMEOUT {timeout}s")
        r["hang"] = True
    except Exception as e:  # noqa: BLE001
        r["errors"].append(f"{type(e).__name__}: {e}"[:300])
    r["t"] = time.perf_counter() - t0
    return r


def session(limit: int = 40) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


async def wait_idle(timeout: float = 60) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = metrics()
        if all(v == 0 for k, v in m.items() if k.startswith("kv_blocks_used") or k.startswith("requests_held")):
            return {"idle_after_s": round(time.time() - t0, 1), **m}
        await asyncio.sleep(1)
    return {"NOT_IDLE_after_s": timeout, **metrics()}


def summarize(results: list[dict]) -> str:
    lines = []
    for r in results:
        flag = ""
        if r.get("hang"):
            flag = " HANG"
        elif not r.get("cancelled") and r["finals"] + (1 if r["errors"] else 0) != 1:
            flag = f" BAD(finals={r['finals']},errors={len(r['errors'])})"
        lines.append(f"{r['name']:>10} st={r['status']} ev={r['events']:4d} fin={r['finish']} "
                     f"t={r['t']:.1f}s first={r['first_s'] and round(r['first_s'], 1)} "
                     f"canc={r.get('cancelled', False)} err={r['errors'][:1]} text={r['text'][:40]!r}{flag}")
    return "\n".join(lines)
