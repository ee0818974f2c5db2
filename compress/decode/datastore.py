"""A datastore of the model's own earlier outputs, for prompt lookup to copy from.

Open-ended requests rarely repeat their prompt, so prompt lookup finds little to copy there.
What a small model writes across requests does repeat: its openings, list markers, stock
phrases. REST (He et al. 2023) drafts from a retrieval datastore; here the corpus is the
target's own greedy outputs on earlier requests, so what is copied is what this model tends
to write. Every n-gram (n = 1..``max_ngram``) remembers where it last occurred (up to ``cap``
places); a lookup takes the longest n-gram ending the context that the store knows and
builds the continuation token by token from the majority of those places (a trie walk by
counts, as REST's). Stored as JSON token lists with the tokenizer's fingerprint: no pickle,
and a store written with another tokenizer is refused.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from .loop import DecodeError, write_json


class Datastore:
    def __init__(self, sequences=(), max_ngram: int = 3, cap: int = 64, tokenizer_id: str = ""):
        self.max_ngram, self.cap, self.tokenizer_id = max_ngram, cap, tokenizer_id
        self.sequences: list[list[int]] = []
        self.places: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)  # n-gram -> (seq, after)
        for tokens in sequences:
            self.add(tokens)

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, tokens: list[int]) -> None:
        """Remember one output."""
        tokens, index = list(tokens), len(self.sequences)
        self.sequences.append(tokens)
        for n in range(1, self.max_ngram + 1):
            for start in range(len(tokens) - n):
                places = self.places[tuple(tokens[start : start + n])]
                places.append((index, start + n))
                if len(places) > 2 * self.cap:  # trimmed in batches: the latest ``cap`` are what lookups read
                    del places[: self.cap]

    def lookup(self, context: list[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` candidates, the n-gram length they matched; 0 with no match)."""
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            places = self.places.get(tuple(context[-n:]), [])[-self.cap :]
            if not places:
                continue
            out = []
            for step in range(k):
                following = [
                    (s, p, self.sequences[s][p + step]) for s, p in places if p + step < len(self.sequences[s])
                ]
                if not following:
                    break
                token = Counter(t for _, _, t in following).most_common(1)[0][0]
                out.append(token)
                places = [(s, p) for s, p, t in following if t == token]
            return out, n
        return [], 0

    @classmethod
    def load(cls, path: str | Path, tokenizer_id: str) -> Datastore:
        """The store at ``path``; an empty one if the file does not exist yet."""
        path = Path(path)
        if not path.parent.is_dir():
            raise DecodeError(f"{path}: folder {path.parent} does not exist; create it or pick another path")
        if not path.exists():
            return cls(tokenizer_id=tokenizer_id)
        try:
            saved = json.loads(path.read_text())
            sequences, saved_id = saved["sequences"], saved["tokenizer"]
            if not all(type(t) is int for tokens in sequences for t in tokens):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise DecodeError(
                f"--datastore {path} is not a compress datastore (JSON with 'tokenizer' and "
                "'sequences'); give a new file name to start one"
            ) from None
        if saved_id != tokenizer_id:
            raise DecodeError(f"{path} was written with another tokenizer; give a new file name for this model")
        return cls(sequences, tokenizer_id=tokenizer_id)

    def save(self, path: str | Path) -> None:
        write_json(Path(path), {"tokenizer": self.tokenizer_id, "sequences": self.sequences})
