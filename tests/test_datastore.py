"""The datastore of earlier outputs: majority continuations of the longest known n-gram, safe
files, and prompt lookup that copies from it stays token-identical to greedy."""

import json

import pytest

from compress.decode import DecodeError, PromptLookup, greedy, speculate
from compress.decode.datastore import Datastore
from tests.conftest import tiny
from tests.test_decode import _prompt


def test_lookup_follows_the_longest_known_ngram_and_the_majority_after_it():
    store = Datastore([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 6, 8], [2, 3, 4, 5, 0]])
    assert store.lookup([0, 2, 3, 4], 3) == ([5, 0], 3)  # "2 3 4": 5 twice, 6 once; then 0 after "2 3 4 5"
    assert store.lookup([8, 8, 7, 3], 2) == ([4, 6], 2)  # only the 2-gram "7 3" is known
    assert store.lookup([42], 3) == ([], 0)


def test_saved_store_reads_back_and_refuses_other_tokenizers_and_other_files(tmp_path):
    path = tmp_path / "store.json"
    assert len(Datastore.load(path, "tok-a")) == 0  # a missing file starts an empty store
    Datastore([[1, 2, 3], [4, 5]], tokenizer_id="tok-a").save(path)
    assert Datastore.load(path, "tok-a").sequences == [[1, 2, 3], [4, 5]]
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left beside it
    with pytest.raises(DecodeError, match="another tokenizer"):
        Datastore.load(path, "tok-b")
    path.write_text(json.dumps({"tokenizer": "tok-a", "sequences": [["not", "ids"]]}))
    with pytest.raises(DecodeError, match="not a compress datastore"):
        Datastore.load(path, "tok-a")
    with pytest.raises(DecodeError, match="does not exist"):
        Datastore.load(tmp_path / "missing" / "store.json", "tok-a")


def test_prompt_lookup_drafts_an_earlier_answer_from_the_store_and_stays_lossless():
    model, prompt = tiny("llama"), _prompt(seed=3)
    plain = greedy(model, prompt, 40)
    lookup = PromptLookup(token_cost=0.05, store=Datastore([plain.tokens]))
    alone = speculate(model, prompt, 40, PromptLookup(token_cost=0.05), k=8)
    stored = speculate(model, prompt, 40, lookup, k=8)
    assert alone.tokens == stored.tokens == plain.tokens
    assert stored.forwards < alone.forwards, (stored.forwards, alone.forwards)
    assert lookup.rates(1, "store")[0] > 0.5  # the store's first guesses were confirmed (prior: 1/2)
