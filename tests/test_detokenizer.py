"""Incremental detokenization: the streamed text equals a full decode (invalid UTF-8 and special tokens
included), the work per token does not grow with the output, a stream whose text keeps ending in an
incomplete character still flows, and stop strings cut where a full decode says, across handoffs too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenrouter import SamplingParams
from tokenrouter.engine.detokenizer import CONTEXT, MAX_HOLD, Detokenizer, special_ids
from tokenrouter.engine.outputs import RequestState
from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.stop import StopChecker
from tokenrouter.routing.policy import Lease
from tokenrouter.transport.messages import Commit

# Token ids one single-token push may decode: the window (at most 2 * CONTEXT, plus the tokens of a young
# run of U+FFFD that blocks compaction), the new token, and one compaction of CONTEXT tokens.
PUSH_BOUND = 3 * CONTEXT + MAX_HOLD + 1


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")


@pytest.fixture(scope="module")
def bench_tok(bench_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(bench_tokenizer_dir)


def full(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def byte_token_ids(tok) -> dict[int, int]:
    """Byte -> the id of the byte-level BPE token for that single byte (GPT-2's printable byte alphabet:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255 in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in char.items()}
    assert all(full(tok, [ids[b]]) == bytes([b]).decode("utf-8", "replace") for b in range(256))
    return ids


def mixed_bytes(rng: random.Random, n: int) -> bytes:
    """Valid multi-byte characters, stray bytes >= 0x80 (invalid UTF-8) and ASCII, shuffled together."""
    out = bytearray()
    while len(out) < n:
        r = rng.random()
        if r < 0.4:
            out += rng.choice("€😀é中a").encode()
        elif r < 0.7:
            out.append(rng.randrange(0x80, 0x100))
        else:
            out.append(rng.randrange(0x20, 0x7F))
    return bytes(out)


def stream(tok, ids: list[int], rng: random.Random) -> tuple[list[str], int]:
    """Push `ids` in chunks of random size; the pieces (flush last) and the most text ever held."""
    d, pieces, i, held = Detokenizer(tok), [], 0, 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3, 7])
        pieces.append(d.push(ids[i : i + k]))
        held = max(held, len(d.held))
        i += k
    pieces.append(d.flush())
    return pieces, held


class CountingDecode:
    """Wraps a tokenizer's `decode` to count the token ids it is given."""

    def __init__(self, tok) -> None:
        self.tok, self.orig, self.calls = tok, tok.decode, []

    def __enter__(self) -> CountingDecode:
        def decode(ids, *args, **kwargs):
            self.calls.append(len(ids))
            return self.orig(ids, *args, **kwargs)

        self.tok.decode = decode
        return self

    def __exit__(self, *exc: object) -> None:
        del self.tok.decode  # the instance attribute; the class's method shows again

    def take(self) -> int:
        n, self.calls = sum(self.calls), []
        return n


# -- equality with a full decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "bench"])
def test_equals_full_decode_on_random_ids(which: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(f"{which}_tok")
    specials = sorted(special_ids(tok))
    assert specials, "the shipped tokenizers have special tokens; the test would not mix them in"
    rng = random.Random(0)
    for _ in range(200):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
            for _ in range(rng.randrange(1, 120))
        ]
        pieces, _ = stream(tok, ids, rng)
        assert "".join(pieces) == full(tok, ids)


def test_equals_full_decode_with_split_and_invalid_characters(tiny_tok) -> None:
    """Byte by byte: characters split across tokens (and across special tokens), stray invalid bytes."""
    byte_id = byte_token_ids(tiny_tok)
    specials = sorted(special_ids(tiny_tok))
    rng = random.Random(1)
    most_held = 0
    for _ in range(500):
        ids = [byte_id[b] for b in mixed_bytes(rng, 60)]
        for _ in range(rng.randrange(6)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        pieces, held = stream(tiny_tok, ids, rng)
        assert "".join(pieces) == full(tiny_tok, ids)
        most_held = max(most_held, held)
    assert most_held <= MAX_HOLD + 1  # a young run of single-byte tokens, then one character
    euro = [byte_id[b] for b in "€".encode()]
    d = Detokenizer(tiny_tok)
    assert [d.push([euro[0]]), d.push([specials[0]]), d.push([euro[1]]), d.push([euro[2]])] == ["", "", "", "€"]


# -- bounded work ------------------------------------------------------------------------------------------


def test_work_per_token_does_not_grow_with_output(tiny_tok) -> None:
    """4,096 output tokens (random ids: invalid UTF-8 and special tokens among them): every path that
    decodes per token gives `decode` a bounded number of ids, the same at the end as at the start."""
    rng = random.Random(2)
    specials = sorted(special_ids(tiny_tok))
    n = 4096
    ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tiny_tok)) for _ in range(n)]
    prompt = [5, 6, 7]
    with CountingDecode(tiny_tok) as count:
        # The detokenizer itself.
        d = Detokenizer(tiny_tok)
        per_push = []
        for t in ids:
            d.push([t])
            per_push.append(count.take())
        assert max(per_push) <= PUSH_BOUND
        assert sum(per_push[-1024:]) <= sum(per_push[:1024]) * 1.5 + 64  # flat, not growing

        # The coordinator's output(), one commit at a time (as it streams deltas).
        params = SamplingParams(max_new_tokens=n, stop=["never-appears\x00"])
        req = RequestState("r", prompt, params, "small")
        per_output = []
        for t in ids:
            req.on_commit(Commit("r", "small", [t]))
            req.output(tiny_tok, final=False)
            per_output.append(count.take())
        assert max(per_output) <= PUSH_BOUND

        # A subserver's stop-string check, and its lease stop-pattern check.
        checker = StopChecker(tiny_tok, set(), 1 << 20)
        seq = Sequence("r", list(prompt), len(prompt), SamplingParams(max_new_tokens=n + 1, stop=["never\x00"]))
        lease = Lease(return_to="small", stop_pattern="\x00\x01never")
        seq.lease = lease
        lease.start = len(seq.token_ids)
        per_check = []
        for t in ids:
            assert not checker.lease_done(seq, t)
            seq.token_ids.append(t)
            assert checker.check(seq, t) == (None, None)
            per_check.append(count.take())
        assert max(per_check) <= 2 * PUSH_BOUND


# -- no stall ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        [0x80],  # lone continuation bytes: every character invalid
        [0xE2, 0x80],  # a 3-byte lead and one continuation, cut off by the next lead: always incomplete
        [0xF0, 0x9F, 0x98],  # a 4-byte character never finished
    ],
)
def test_text_that_keeps_ending_incomplete_still_flows(tiny_tok, pattern: list[int]) -> None:
    """The field bug: the text ends in U+FFFD after every token. It must still be emitted within a bounded
    number of tokens (not held until the end), and nothing is sent twice."""
    byte_id = byte_token_ids(tiny_tok)
    ids = [byte_id[b] for b in pattern * 64]
    d = Detokenizer(tiny_tok)
    emitted, silent = "", 0
    for i, t in enumerate(ids):
        new = d.push([t])
        emitted += new
        silent = 0 if new else silent + 1
        assert silent <= MAX_HOLD, f"no text for {silent} tokens"
        assert len(d.held) <= MAX_HOLD + 1
        assert full(tiny_tok, ids[: i + 1]) == emitted + d.held  # held back, never lost or repeated
    assert emitted + d.flush() == full(tiny_tok, ids)


def test_request_state_streams_held_text_and_never_repeats(tiny_tok) -> None:
    byte_id = byte_token_ids(tiny_tok)
    rng = random.Random(3)
    ids = [byte_id[b] for b in mixed_bytes(rng, 400)]
    req = RequestState("r", [1], SamplingParams(max_new_tokens=1000), "small")
    deltas, silent = [], 0
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        req.on_commit(Commit("r", "small", [t], "length" if last else None))
        out = req.output(tiny_tok, final=last)
        deltas.append(out.delta_text)
        silent = 0 if out.delta_text else silent + 1
        assert silent <= MAX_HOLD
        assert out.text == "".join(deltas)
    assert "".join(deltas) == full(tiny_tok, ids)


# -- stop strings ------------------------------------------------------------------------------------------


def naive_stop(tok, out: list[int], stops: list[str]) -> tuple[int, int] | None:
    """(tokens through the first one whose full decode contains a stop string, where the earliest
    occurrence starts), from full decodes."""
    for k in range(1, len(out) + 1):
        text = full(tok, out[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, min(hits)
    return None


def simulate(tok, prompt: list[int], out: list[int], stops: list[str], rng: random.Random, away: list[int]):
    """Models take turns on one request as subservers do: each has its own Sequence (made on the first
    visit from everything so far, extended by the suffix it missed on a return) and checks the tokens it
    commits. Returns the commits until a stop, as (model, token, finish_reason, stop_trim)."""
    checker = StopChecker(tok, set(), 1 << 20)
    params = SamplingParams(max_new_tokens=1 << 20, stop=stops)
    tokens, seqs, commits, owner, i = list(prompt), {}, [], 0, 0
    while i < len(out):
        seq = seqs.get(owner)
        if seq is None:
            seq = seqs[owner] = Sequence("r", list(tokens), len(prompt), params)
        else:
            seq.token_ids.extend(tokens[len(seq.token_ids) :])
        for _ in range(rng.choice(away)):
            if i == len(out):
                break
            t = out[i]
            i += 1
            seq.token_ids.append(t)
            tokens.append(t)
            reason, trim = checker.check(seq, t)
            commits.append((owner, t, reason, trim))
            if reason is not None:
                return commits
        owner = rng.randrange(3)
    return commits


@pytest.mark.parametrize("away", [[1], [1, 2, 3], [1, 40, 150]])
def test_stop_strings_across_models_cut_where_a_full_decode_does(tiny_tok, away: list[int]) -> None:
    """Random output (invalid bytes and special tokens included) committed by three models in turns;
    stop strings picked from the text, many spanning tokens of different models. The finishing commit and
    the text the coordinator builds from the commits equal the naive full-decode answer."""
    rng = random.Random(4)
    specials = sorted(special_ids(tiny_tok))
    byte_id = byte_token_ids(tiny_tok)
    prompt = [10, 11, 12]
    checked = 0
    for trial in range(60):
        if trial % 2:
            out = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tiny_tok)) for _ in range(300)]
        else:
            out = [byte_id[b] for b in mixed_bytes(rng, 300)]
        text = full(tiny_tok, out)
        # A stop that may come early (while the text is shorter than the longest stop), later ones, and at
        # times a long one that never matches (a longer tail to keep).
        stops = ["\x00never appears here"] if trial % 3 == 0 else []
        for j in range(rng.randrange(1, 4)):
            a = rng.randrange(min(8, len(text))) if j == 0 else rng.randrange(len(text) // 3, len(text))
            s = text[a : a + rng.randrange(1, 9)]
            if s and "\ufffd" not in s:
                stops.append(s)
        if len(stops) == (trial % 3 == 0):
            continue
        expected = naive_stop(tiny_tok, out, stops)
        commits = simulate(tiny_tok, prompt, out, stops, rng, away)
        assert expected is not None
        k, at = expected
        assert len(commits) == k and commits[-1][2] == "stop"
        assert all(c[2] is None for c in commits[:-1])
        assert commits[-1][3] == len(full(tiny_tok, out[:k])) - at
        # The coordinator's side: one commit at a time, streaming.
        req = RequestState("r", prompt, SamplingParams(max_new_tokens=1 << 20, stop=stops), "m0")
        deltas = []
        for j, (model, t, reason, trim) in enumerate(commits):
            req.on_commit(Commit("r", f"m{model}", [t], reason, trim))
            deltas.append(req.output(tiny_tok, final=j == len(commits) - 1).delta_text)
        expected_text = full(tiny_tok, out[:k])[:at]
        assert "".join(deltas) == expected_text
        assert req.output(tiny_tok, final=True).text == expected_text
        checked += 1
    assert checked >= 40


def test_lease_stop_pattern_equals_full_decode(tiny_tok) -> None:
    """The lease check (text produced since the lease began ends with the pattern) over random ids, with
    several leases in a row on one sequence."""
    rng = random.Random(5)
    byte_id = byte_token_ids(tiny_tok)
    ids = [byte_id[b] for b in mixed_bytes(rng, 2000)]
    checker = StopChecker(tiny_tok, set(), 1 << 20)
    seq = Sequence("r", [1, 2], 2, SamplingParams())
    hits = 0
    for t in ids:
        if seq.lease is None or rng.random() < 0.05:
            tail = full(tiny_tok, seq.token_ids[-3:])
            pattern = tail[-rng.randrange(1, 3) :] if tail and "\ufffd" not in tail else "a"
            seq.lease = Lease(return_to="small", stop_pattern=pattern, start=len(seq.token_ids))
        lease = seq.lease
        want = full(tiny_tok, seq.token_ids[lease.start :] + [t]).endswith(lease.stop_pattern)
        assert checker.lease_done(seq, t) == want
        hits += want
        seq.token_ids.append(t)
        if want:
            seq.lease = None
    assert hits > 10


# -- in the engine -----------------------------------------------------------------------------------------


def test_stop_string_spanning_a_handoff_matches_the_naive_reference(tiny_dir: Path) -> None:
    """The random policy hands tokens to the large model often; a stop string made of the last characters
    of one model's token and the first of the other's stops the request exactly where the naive reference
    (a full decode of its tokens) does, and the streamed deltas add up to that text."""
    from test_routing_vs_naive import make_engine, naive_generate, prompts_for

    models, policy = ["small", "large"], {"name": "random", "p": 0.5, "seed": 11}
    engine = make_engine(tiny_dir, models, policy)
    tok = engine.tokenizer
    commits: list[tuple[str, int]] = []
    for name, sub in engine.subservers.items():

        def emit(ev, orig=sub.emit, name=name):
            if isinstance(ev, Commit):
                commits.extend((name, t) for t in ev.token_ids)
            orig(ev)

        sub.emit = emit
    n = 40
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    tried = 0
    for prompt in prompts_for(engine.vocab_size)[:4]:
        commits.clear()
        (plain,) = engine.generate([prompt], greedy)
        ref_tokens, _ = naive_generate(tiny_dir, models, policy, prompt, n)
        assert plain.token_ids == ref_tokens
        by = [m for m, _ in commits]
        # A token k (1-based) committed by another model than token k-1, whose text adds to the text so far.
        for k in range(3, n + 1):
            before, after = full(tok, ref_tokens[: k - 1]), full(tok, ref_tokens[:k])
            if by[k - 2] == by[k - 1] or "\ufffd" in after or len(before) < 2 or len(after) <= len(before):
                continue
            s = after[len(before) - 2 : len(before) + 1]  # two characters before the handoff, one after
            if after.find(s) != len(before) - 2:
                continue
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, stop=[s, "\x00never"])
            outs: list = []
            engine.add_request(prompt, params, listener=outs.append)
            while engine.has_unfinished():
                engine.step()
            final = outs[-1]
            assert [o.finished for o in outs].count(True) == 1 and final.finished
            assert final.finish_reason == "stop"
            assert final.token_ids == ref_tokens[:k]
            assert final.text == after[: len(before) - 2]
            assert "".join(o.delta_text for o in outs) == final.text
            tried += 1
            break
    assert tried >= 2, "no stop string spanning a handoff was found; the test would prove nothing"
    engine.check_integrity()
    engine.shutdown()
