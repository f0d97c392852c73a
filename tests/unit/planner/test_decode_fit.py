"""The decode model's fit and predictor (planner/decode_fit.py, issue #26 item 1), on numbers
worked out by hand here.

The synthetic run: a GDN layer takes 0.1 ms; an attention layer 0.12 ms at 64 tokens, 0.2 at
32,768 and 0.9 at 250,000; the fixed term 5.0, 5.05 and 5.4 ms. The arms are those of
benchmarks/decode_model.py: p4 (3 GDN + 1 attention) and p16 (12 + 4) at every context, g16 (16
GDN) at 64 tokens only. Their step times, by hand:

    p4:  5.0 + 0.3 + 0.12 = 5.42    5.05 + 0.3 + 0.2 = 5.55    5.4 + 0.3 + 0.9 = 6.6
    p16: 5.0 + 1.2 + 0.48 = 6.68    5.05 + 1.2 + 0.8 = 7.05    5.4 + 1.2 + 3.6 = 10.2
    g16: 5.0 + 1.6 = 6.6
"""

from __future__ import annotations

import pytest

from vllm_dualgpu.planner import ModelSpec, reference_config
from vllm_dualgpu.planner.decode_fit import (
    DecodeFractions,
    LayerRead,
    Measured,
    UnderDetermined,
    fit_layer_times,
    fractions_from_times,
    layer_reads,
    predict_step_ms,
)

S, M, L = 64, 32_768, 250_000
P4, P16, G16 = (3, 1), (12, 4), (16, 0)
RUN = [(P4, S, 5.42), (P4, M, 5.55), (P4, L, 6.6), (P16, S, 6.68), (P16, M, 7.05), (P16, L, 10.2), (G16, S, 6.6)]


def points(rows):
    return [Measured(g, a, c, ms) for (g, a), c, ms in rows]


def test_the_fit_recovers_the_layer_times_and_the_fixed_term():
    t = fit_layer_times(points(RUN))
    assert t.gdn_ms == pytest.approx(0.1, abs=1e-9)
    assert t.attention_ms == pytest.approx({S: 0.12, M: 0.2, L: 0.9}, abs=1e-9)
    assert t.fixed_ms == pytest.approx({S: 5.0, M: 5.05, L: 5.4}, abs=1e-9)
    assert t.max_residual_ms == pytest.approx(0.0, abs=1e-9) and t.points == 7
    assert t.step_ms(48, 16, L) == pytest.approx(5.4 + 4.8 + 14.4)  # the 64-layer model, by the fit


def test_a_repeated_reading_is_averaged_and_its_spread_reported():
    # p4 at 64 tokens read twice, 0.04 ms apart: least squares sits between them
    t = fit_layer_times(points(RUN + [(P4, S, 5.46)]))
    assert t.max_residual_ms == pytest.approx(0.02, abs=1e-6)
    assert 5.42 < t.step_ms(3, 1, S) < 5.46


@pytest.mark.parametrize("rows,names", [
    # every arm in the reference's pattern (p8 = 6 + 2 instead of g16): the GDN and attention
    # layers move together, 3 to 1, whatever the count of readings
    ([r for r in RUN if r[0] != G16] + [((6, 2), S, 6.05)],
     "do not tell apart the time of a GDN layer, the time of an attention layer at 64 tokens"),
    # one arm at 32,768 tokens (read twice): its fixed term and attention layer cannot be told apart
    ([r for r in RUN if not (r[0] == P16 and r[1] == M)] + [(P4, M, 5.55)],
     "do not tell apart the fixed time at 32768 tokens and the time of an attention layer at 32768 tokens"),
    # two points for seven unknowns
    (RUN[:2], "2 points for 5 unknowns"),
])
def test_an_under_determined_set_of_arms_is_refused(rows, names):
    with pytest.raises(UnderDetermined, match=names):
        fit_layer_times(points(rows))


# One GDN layer of 480 MB with a 1 MB state (read and written: 482 MB a step), one attention
# layer of 240 MB with 2,048 bytes of KV per token; a 4,800 GB/s card.
GDN = LayerRead("linear_attention", 480_000_000, 0, 1_000_000)
ATT = LayerRead("full_attention", 240_000_000, 2048, 0)


def test_fractions_from_the_fitted_times():
    t = fit_layer_times(points(RUN))
    fr = fractions_from_times(t, GDN, ATT, bandwidth_gbps=4800, weight_format="fp8", drafter="mtp", run="run-x")
    # GDN: 482e6 B in 0.1 ms = 4,820 GB/s, 1.00417 of 4,800
    assert fr.gdn == pytest.approx(482e6 / 1e-4 / 4.8e12)
    # attention: a line through (64, 0.12) and (250,000, 0.9): 0.78 / 249,936 ms per token, so the
    # weights take 0.12 - 64 x that = 0.1198003 ms and the KV 2,048 B per 3.1208e-6 ms
    per_tok = 0.78 / 249_936
    assert fr.attention == pytest.approx(240e6 / ((0.12 - 64 * per_tok) * 1e-3) / 4.8e12)
    assert fr.kv == pytest.approx(2048 / (per_tok * 1e-3) / 4.8e12)
    # fixed: a line through (64, 5.0) and (250,000, 5.4)
    assert fr.fixed_ms_per_token == pytest.approx(0.4 / 249_936)
    assert fr.fixed_ms == pytest.approx(5.0 - 64 * 0.4 / 249_936)
    assert (fr.weight_format, fr.drafter, fr.run, fr.bandwidth_gbps) == ("fp8", "mtp", "run-x", 4800)
    assert DecodeFractions.from_dict(fr.to_dict()) == fr


def test_one_context_leaves_the_kv_read_unseparated():
    t = fit_layer_times(points([r for r in RUN if r[1] == S]))
    fr = fractions_from_times(t, GDN, ATT, bandwidth_gbps=4800, weight_format="fp8", drafter="none", run="r")
    assert fr.kv is None and fr.fixed_ms_per_token == 0.0 and fr.fixed_ms == pytest.approx(5.0)
    assert fr.attention == pytest.approx((240e6 + 64 * 2048) / 0.12e-3 / 4.8e12)
    assert any("KV read is not separated" in n for n in fr.notes)


def test_a_non_positive_time_is_flagged_not_divided():
    t = fit_layer_times(points([((3, 1), S, 5.0), ((12, 4), S, 5.0), ((16, 0), S, 4.0)]))  # GDN -1/16 ms
    fr = fractions_from_times(t, GDN, ATT, bandwidth_gbps=4800, weight_format="fp8", drafter="none", run="r")
    assert fr.gdn is None and any("GDN layer" in n and "not positive" in n for n in fr.notes)
    with pytest.raises(ValueError, match="no achieved fraction for linear_attention layers"):
        predict_step_ms([GDN, ATT], fr, context=S, bandwidth_gbps=4800)
    assert predict_step_ms([ATT], fr, context=S, bandwidth_gbps=4800, fixed=False) > 0  # attention alone: fine


FR = DecodeFractions("fp8", "mtp", gdn=0.5, attention=0.5, kv=0.4, fixed_ms=5.0, fixed_ms_per_token=1e-5,
                     bandwidth_gbps=4800, run="r")


def test_the_predictor_for_given_fractions():
    # GDN: 482e6 / (0.5 x 4.8e12) = 0.20083 ms each; attention weights 240e6 / 2.4e12 = 0.1 ms;
    # KV at 100,000 tokens 204.8e6 / (0.4 x 4.8e12) = 0.10667 ms; fixed 5 + 1 = 6 ms
    reads = [GDN, GDN, GDN, ATT]
    assert predict_step_ms(reads, FR, context=100_000, bandwidth_gbps=4800) == pytest.approx(
        3 * 0.2008333333 + 0.1 + 0.1066666667 + 6.0)
    assert predict_step_ms(reads, FR, context=100_000, bandwidth_gbps=4800, fixed=False) == pytest.approx(
        3 * 0.2008333333 + 0.1 + 0.1066666667)
    # half the bandwidth: the layers take twice as long, the fixed term does not move
    assert predict_step_ms(reads, FR, context=100_000, bandwidth_gbps=2400) == pytest.approx(
        2 * (3 * 0.2008333333 + 0.1 + 0.1066666667) + 6.0)
    # without a KV fraction the attention fraction covers the KV read: 204.8e6 / 2.4e12 = 0.08533 ms
    no_kv = DecodeFractions(**{**FR.to_dict(), "kv": None})
    assert predict_step_ms([ATT], no_kv, context=100_000, bandwidth_gbps=4800, fixed=False) == pytest.approx(
        0.1 + 0.0853333333)


def test_layer_reads_are_the_planners_counts_for_the_reference():
    """The bundled reference (FP8 block, fp8 KV): a GDN layer reads 383,909,920 weight bytes and
    a 3,268,608-byte state (conv 10,240 x (3 + 3 MTP tokens) x 2 B + recurrent 48 x 128 x 128 x
    4 B); an attention layer 372,356,864 bytes and 4 KV heads x (256 + 256) x 1 B per token."""
    m = ModelSpec.from_hf_config(reference_config())
    reads = layer_reads(m, "fp8", num_speculative_tokens=3)
    assert len(reads) == 64 and [r.kind for r in reads[:4]] == ["linear_attention"] * 3 + ["full_attention"]
    assert reads[0] == LayerRead("linear_attention", 383_909_920, 0, 10_240 * 6 * 2 + 48 * 128 * 128 * 4)
    assert reads[3] == LayerRead("full_attention", 372_356_864, 4 * 512, 0)
