"""The CPU part of the e2e comparison (gpu_tokens): prompts and how two runs' tokens are compared."""

from __future__ import annotations

import pytest

import gpu_tokens as e2e


def test_prompts_mixed_lengths_and_shared_prefixes():
    p = e2e.build_prompts(seed=0, vocab=4096)
    prompts, fam = p["prompts"], p["family"]
    assert len(prompts) >= 32 and len(fam) == len(prompts) == len(p["max_tokens"])
    lengths = [len(x) for x in prompts]
    assert min(lengths) < 20 and max(lengths) > 2000 and len(set(lengths)) >= 16
    assert len(set(p["max_tokens"])) >= 3
    assert all(n + m <= e2e.MAX_MODEL_LEN for n, m in zip(lengths, p["max_tokens"]))
    assert all(3 <= t < 4096 for x in prompts for t in x)
    families = sorted({f for f in fam if f is not None})
    assert len(families) == len(p["prefixes"]) >= 4
    for f in families:
        members = [x for x, g in zip(prompts, fam) if g == f]
        assert len(members) >= 2 and len(p["prefixes"][f]) >= 100
        assert all(x[: len(p["prefixes"][f])] == p["prefixes"][f] and len(x) > len(p["prefixes"][f]) for x in members)
    singles = [x for x, g in zip(prompts, fam) if g is None]
    heads = [tuple(x[:16]) for x in prompts]
    assert all(heads.count(tuple(x[:16])) == 1 for x in singles if len(x) >= 16)


def test_prompts_deterministic_per_seed():
    assert e2e.build_prompts(seed=0) == e2e.build_prompts(seed=0)
    assert e2e.build_prompts(seed=0)["prompts"] != e2e.build_prompts(seed=1)["prompts"]


# --- comparison ---------------------------------------------------------------------------------


def test_first_difference():
    assert e2e.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert e2e.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert e2e.first_difference([5], [6]) == 0
    assert e2e.first_difference([1, 2, 3], [1, 2]) == 2
    assert e2e.first_difference([], [4]) == 0


def _lps(outputs, gap_at=None, gap=1.0, alt=None):
    """Top-2 logprobs per position: the emitted token first; at gap_at, alt second with gap."""
    res = []
    for i, toks in enumerate(outputs):
        row = []
        for j, t in enumerate(toks):
            second = alt if (gap_at == (i, j) and alt is not None) else 9999
            row.append([[t, -0.1], [second, -0.1 - (gap if gap_at == (i, j) else 3.0)]])
        res.append(row)
    return res


def test_token_logprobs_is_what_compare_reads():
    """vLLM's per-position {token: Logprob} dicts become [token, logprob] pairs, best first."""
    from types import SimpleNamespace as NS

    completion = NS(logprobs=[{7: NS(logprob=-2.0), 5: NS(logprob=-0.1234567)}, {9: NS(logprob=-0.5)}])
    assert e2e.token_logprobs(completion) == [[[5, -0.12346], [7, -2.0]], [[9, -0.5]]]
    assert e2e.token_logprobs(NS(logprobs=None)) == []


def test_compare_reports_first_differing_index():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [7, 7]]
    got = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 42, 43], [7, 7]]
    c = e2e.compare(ref, got)
    assert not c["ok"] and c["identical"] == 2 and c["prompts"] == 3
    (m,) = c["mismatches"]
    assert (m["prompt"], m["first_diff"], m["ref_token"], m["got_token"]) == (1, 5, 10, 42)
    assert e2e.compare(ref, [list(x) for x in ref]) == {"prompts": 3, "identical": 3, "near_ties": 0,
                                                       "mismatches": [], "ok": True}


def test_compare_near_ties_only_when_not_strict():
    ref, got = [[1, 2, 3]], [[1, 2, 8]]
    tie_ref, tie_got = _lps(ref, (0, 2), 0.02, alt=8), _lps(got, (0, 2), 0.03, alt=3)
    loose = e2e.compare(ref, got, tie_ref, tie_got, tie_tol=0.1, strict=False)
    assert loose["ok"] and loose["near_ties"] == 1
    m = loose["mismatches"][0]
    assert m["near_tie"] and m["gap_ref"] == pytest.approx(0.02) and m["gap_got"] == pytest.approx(0.03)
    assert not e2e.compare(ref, got, tie_ref, tie_got, tie_tol=0.1, strict=True)["ok"]
    # A wide gap in either run is a real divergence.
    wide = e2e.compare(ref, got, tie_ref, _lps(got, (0, 2), 0.9, alt=3), tie_tol=0.1, strict=False)
    assert not wide["ok"] and not wide["mismatches"][0]["near_tie"]
    # The other run's token missing from the top-k: no gap, no tie.
    absent = e2e.compare(ref, got, _lps(ref), tie_got, tie_tol=0.1, strict=False)
    assert not absent["ok"] and absent["mismatches"][0]["gap_ref"] is None


def test_compare_length_differences_are_never_ties():
    c = e2e.compare([[1, 2, 3]], [[1, 2]], _lps([[1, 2, 3]]), _lps([[1, 2]]), strict=False)
    assert not c["ok"] and c["mismatches"][0]["first_diff"] == 2 and c["mismatches"][0]["got_token"] is None
    assert not e2e.compare([[1]], [[1], [2]])["ok"]


# --- runs and comparisons wiring ----------------------------------------------------------------
