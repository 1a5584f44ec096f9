#!/usr/bin/env python3
"""Writes Mooncake-format traces with other shapes than the conversation trace, to check that
the eviction policy tuned on one trace holds on others (docs/BENCH.md "Hits on real traffic").

    python3 tools/lunakv/scripts/synth_traces.py OUT_DIR

- toolagent.jsonl: 40 shared tool prefixes of 5-40 blocks, picked by a Zipf law, each
  request adding 1-20 blocks of its own (an agent calling tools);
- multiturn.jsonl: conversations on 10 system prompts, 60% continuing after a gap of up to
  3000 requests (the previous input minus its partial last block, plus 1-8 new blocks);
- multiturn_short.jsonl: the same with gaps of up to 200 requests.

Deterministic (fixed seeds): the same files on every machine.
"""
import heapq
import json
import os
import random
import sys


def _writer(path):
    f = open(path, "w")

    def write(i, ids, rnd):
        f.write(json.dumps({
            "timestamp": i * 100,
            "input_length": len(ids) * 512 - rnd.randint(0, 400),
            "output_length": 100,
            "hash_ids": ids,
        }) + "\n")
    return f, write


def _ids():
    nid = [0]

    def new(k):
        r = list(range(nid[0], nid[0] + k))
        nid[0] += k
        return r
    return new


def toolagent(path, n=12000, prefixes=40, seed=1):
    rnd, new = random.Random(seed), _ids()
    tools = [new(rnd.randint(5, 40)) for _ in range(prefixes)]
    weights = [1 / (i + 1) ** 1.1 for i in range(prefixes)]
    f, write = _writer(path)
    with f:
        for i in range(n):
            write(i, rnd.choices(tools, weights)[0] + new(rnd.randint(1, 20)), rnd)


def multiturn(path, n=12000, seed=2, p_continue=0.6, max_gap=3000):
    rnd, new = random.Random(seed), _ids()
    system = [new(rnd.randint(1, 6)) for _ in range(10)]
    pending = []
    f, write = _writer(path)
    with f:
        for i in range(n):
            if pending and pending[0][0] <= i:
                _, _, prefix = heapq.heappop(pending)
                ids = prefix + new(rnd.randint(1, 8))
            else:
                ids = rnd.choice(system) + new(rnd.randint(2, 30))
            write(i, ids, rnd)
            if rnd.random() < p_continue:
                heapq.heappush(pending, (i + rnd.randint(1, max_gap), rnd.random(), ids[:-1]))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    toolagent(os.path.join(out, "toolagent.jsonl"))
    multiturn(os.path.join(out, "multiturn.jsonl"))
    multiturn(os.path.join(out, "multiturn_short.jsonl"), seed=3, max_gap=200)


if __name__ == "__main__":
    main()
