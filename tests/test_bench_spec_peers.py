"""bench/spec_peers.py's pure helpers: argument edits, the decode rate, greedy agreement, the JSON summary."""

from bench.spec_peers import agreement, decode_rate, drop_arg, set_arg, summarize


def test_set_and_drop_arg():
    argv = ["llama-server", "-c", "32768", "-np", "32"]
    assert set_arg(argv, "-c", "256") == ["llama-server", "-c", "256", "-np", "32"]
    assert set_arg(argv, "-t", "2")[-2:] == ["-t", "2"]
    assert drop_arg(argv, "-np") == ["llama-server", "-c", "32768"]
    assert drop_arg(argv, "-x") == argv


def test_decode_rate():
    reqs = [{"times": [0.1, 0.2, 0.3], "completion_tokens": 3, "error": None},
            {"times": [0.1, 0.5], "completion_tokens": 5, "error": None},
            {"times": [], "completion_tokens": None, "error": "HTTP 500"}]
    r = decode_rate(reqs)
    assert r["errors"] == 1 and r["generated_tokens"] == 8
    assert r["decode_tok_s"] == round((2 + 4) / (0.2 + 0.4), 2)
    assert r["e2e_tok_s"] == round(8 / 0.8, 2)
    assert r["ttft_ms_p50"] == 100.0


def test_agreement():
    ids = {"ours-off": [[1, 2], [3], None], "llama-off": [[1, 2], [4], [5]]}
    assert agreement(ids, "ours-off") == {"llama-off": {"identical": 1, "compared": 2, "fraction": 0.5,
                                                        "first_mismatch": [(1, 0, 1)]}}
    assert agreement({"llama-off": [[1]]}, "ours-off") == {}


def test_summarize_pairs_rounds():
    def rec(rnd, v):
        return {"round": rnd, "decode_tok_s": v, "ttft_ms_p50": 1.0, "e2e_tok_s": v / 2}

    rounds = {"ours-off": [rec(1, 100), rec(2, 110)], "ours-ngram": [rec(1, 200), rec(2, 231)],
              "llama-off": [rec(1, 150), rec(2, 150)], "llama-ngram": [rec(1, 300), rec(2, 200)],
              "llama-ngram-defaults": [rec(2, 100)]}
    s = summarize(rounds)
    assert s["servers"]["ours-ngram"]["decode_tok_s"] == 215.5 and s["servers"]["ours-ngram"]["range"] == [200, 231]
    assert s["ratios"]["ours-ngram / ours-off"] == 2.05  # median of 2.0 and 2.1
    assert s["ratios"]["ours-ngram / llama-ngram"] == round((200 / 300 + 231 / 200) / 2, 3)
    assert s["ratios"]["ours-ngram / llama-ngram-defaults"] == 2.31  # round 2 only: same-round pairs
    assert s["goal"]["ratio"] == s["ratios"]["ours-ngram / llama-ngram"] and not s["goal"]["met"]


def test_summarize_drops_busy_rounds():
    rounds = {"ours-off": [{"round": 1, "decode_tok_s": 100, "other_cpu_share": 0.0},
                           {"round": 2, "decode_tok_s": 10, "other_cpu_share": 0.5}],
              "ours-ngram": [{"round": 1, "decode_tok_s": 200, "other_cpu_share": 0.01},
                             {"round": 2, "decode_tok_s": 200, "other_cpu_share": 0.0}]}
    assert summarize(rounds)["ratios"]["ours-ngram / ours-off"] == 11.0  # median of 2 and 20
    quiet = summarize(rounds, 0.05)
    assert quiet["ratios"]["ours-ngram / ours-off"] == 2.0 and quiet["servers"]["ours-off"]["rounds"] == 1
