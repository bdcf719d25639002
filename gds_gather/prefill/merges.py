"""The merge loops of the BPE tokenizers, as llama.cpp runs them: from single characters, repeatedly merge the best
adjacent pair (bpe_merge: lowest merge rank; spm_merge: the highest-scored token) until none merges. Imports
nothing of gds_gather."""
from __future__ import annotations

import heapq

def merge(word: str, priority) -> list[str]:
    """From single characters, repeatedly merge the adjacent pair with the lowest priority(a, b) (leftmost on ties)
    until no adjacent pair has one (priority returns None). A heap over bigrams, as llama.cpp's sessions do."""
    n = len(word)
    if n < 2:
        return [word] if n else []
    sym = list(word)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        k = priority(sym[i], sym[i + 1])
        if k is not None:
            heap.append((k, i, i + 1, sym[i] + sym[i + 1]))
    if not heap:
        return sym
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, left, right, text = pop(heap)
        a, b = sym[left], sym[right]
        if not a or not b or a + b != text:
            continue            # outdated: one side has merged since
        sym[left], sym[right] = text, ""
        nr = nxt[right]
        nxt[left] = nr
        if nr >= 0:
            prv[nr] = left
        p = prv[left]
        if p >= 0:
            k = priority(sym[p], text)
            if k is not None:
                push(heap, (k, p, left, sym[p] + text))
        if nr >= 0:
            k = priority(text, sym[nr])
            if k is not None:
                push(heap, (k, left, nr, text + sym[nr]))
    return [s for s in sym if s]


def bpe_merge(word: str, ranks: dict) -> list[str]:
    """llama.cpp's llm_tokenizer_bpe_session: merges by lowest merge rank."""
    get = ranks.get
    return merge(word, lambda a, b: get((a, b)))


def spm_merge(text: str, ids: dict, scores: list[float]) -> list[str]:
    """llama.cpp's llm_tokenizer_spm: merges the pair whose concatenation is the token of highest score."""
    get = ids.get

    def priority(a, b):
        t = get(a + b)
        return None if t is None else -scores[t]
    return merge(text, priority)
