"""Text on the replica: incremental detokenization and stop strings."""



from deployments.replica.text import ByteTokenizer, Detokenizer, StopMatcher


def test_detokenizer_holds_incomplete_utf8():
    tok = ByteTokenizer(512)
    ids = tok.encode("hé!")
    d = Detokenizer(tok)
    assert d.push(ids[:2]) == "h"  # 'é' is two bytes: wait for the second
    assert d.push(ids[2:]) == "é!"


def test_stop_matcher_across_deltas():
    m = StopMatcher(["END"])
    out = []
    for piece in ["ab", "cE", "N", "Dxyz"]:
        text, hit = m.feed(piece)
        out.append(text)
    assert "".join(out) == "abc" and hit
    m2 = StopMatcher(["zz"])
    assert m2.feed("abz") == ("ab", False) and m2.flush() == "z"


def test_detokenizer_streams_the_default_tokenizer_losslessly():
    """Token by token, the deltas join to the whole output's decode: multi-byte
    characters split across byte-level tokens, emoji, CJK, leading spaces, newlines."""
    from transformers import AutoTokenizer

    from treespark.models.fetch import default_cache_dir, fetch_default_target

    tok = AutoTokenizer.from_pretrained(fetch_default_target(default_cache_dir(), progress=False))
    text = "Hé said: 你好, world 🙂!\n  def f(x):\n\treturn x ** 2  # ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    d = Detokenizer(tok)
    deltas = [d.push([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "" in deltas  # some token only started a character, and waited for the next
    d2 = Detokenizer(tok)
    assert d2.push(ids[:7]) + d2.push(ids[7:]) == tok.decode(ids)
