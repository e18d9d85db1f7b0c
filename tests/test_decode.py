"""effattn decode: CLI end to end and resume, argument errors, exact state sizes, and the summary
numbers computed from hand-made records. Timings are never asserted (only that they exist)."""

import csv
import json

import pytest
import torch
from conftest import assert_png, load_results

import effattn
from effattn.cli import main
from effattn.cli.decode import make_configs, parse_methods
from effattn.kernelized.core import RecurrentState
from effattn.mechanisms.local import WindowCache
from effattn.mechanisms.softmax import KVCache
from effattn.nn.models import DecoderLM
from effattn.tools import decode

# B = 1, 2; H = 2, D = Dv = 8; one layer; 4-token prompt.
TINY = ["--lengths", "8,16,32", "--batch", "1,2", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--vocab", "32", "--prompt-len", "4"]
PROMPT, HEADS, HEAD_DIM = 4, 2, 8


def test_cli_end_to_end_writes_results_plots_and_resumes(tmp_path, capsys):
    out = tmp_path / "decode"
    args = ["decode", "--methods", "softmax", "linear", *TINY, "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "4 runs measured, 0 already" in printed
    assert "== batch 2 ==" in printed and "speed-up over softmax" in printed
    assert "B=1 linear: flatness" in printed and "Peng et al. 2021" in printed
    # The goals are defined at 2048 tokens and from 128 to 8192: not judged at 8..32 tokens.
    assert "NOT met" not in printed and "[<= 1.2x: met]" not in printed
    assert "[< 10%: defined at 2048 tokens, not measured]" in printed
    assert "[<= 1.2x: defined from 128 to 8192 tokens, not measured]" in printed

    records = load_results(out)
    assert len(records) == 2 * 2 * 3
    for r in records:
        assert r["status"] == "ok", r
        assert r["ms_per_token"] > 0 and r["tokens_per_s"] > 0 and r["peak_mib"] >= 0
        assert r["decode_s"] > 0 and r["state_mib"] == r["state_bytes"] / 2**20
    by = {(r["method"], r["batch"], r["length"]): r for r in records}
    for b in (1, 2):
        # softmax: a KV cache, one (key, value) row per position seen (prompt + decoded), float32.
        for n in (8, 16, 32):
            soft = by["softmax", b, n]
            assert soft["state_bytes"] == b * HEADS * (PROMPT + n) * 2 * HEAD_DIM * 4
            assert soft["state_alloc_bytes"] >= soft["state_bytes"]
        # linear: the fixed (F, Dv + 1) state with F = D, and a log-scale per head.
        fixed = b * HEADS * (HEAD_DIM * (HEAD_DIM + 1) + 1) * 4
        assert [by["linear", b, n]["state_bytes"] for n in (8, 16, 32)] == [fixed] * 3
        assert [by["linear", b, n]["state_alloc_bytes"] for n in (8, 16, 32)] == [fixed] * 3

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and rows[0]["status"] == "ok"
    assert set(decode.CSV_FIELDS) <= set(rows[0])
    for png in ("time_per_token.png", "state_memory.png", "tokens_per_s.png"):
        assert_png(out / png)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["methods"] == ["softmax", "linear"]
    assert summary["goals"]["length"] == 32  # 2048 was not measured: the largest length
    assert summary["rows"] == json.loads(json.dumps(decode.summarize(
        decode.with_speedup(records), 32)))

    # The same command again runs nothing and leaves the records as they were.
    assert main(args) == 0
    assert "0 runs measured, 4 already" in capsys.readouterr().out
    assert load_results(out) == records

    # A run with a missing record (interrupted) runs again, and only it.
    missing = next(r for r in records if r["method"] == "linear" and r["batch"] == 2)
    (out / "results.json").write_text(json.dumps([r for r in records if r is not missing]))
    assert main(args) == 0
    assert "1 runs measured, 3 already" in capsys.readouterr().out
    again = {(r["method"], r["batch"], r["length"]): r for r in load_results(out)}
    assert len(again) == len(records)
    for key, r in by.items():
        same = r["timestamp"] == again[key]["timestamp"]
        assert same == (key[:2] != ("linear", 2)), key


def test_max_seconds_records_too_slow_after_the_lengths_reached(tmp_path):
    out = tmp_path / "slow"
    assert main(["decode", "--methods", "linear", "--lengths", "1,2,50000", "--batch", "1",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--max-seconds", "0.2",
                 "--out", str(out)]) == 0
    status = {r["length"]: r["status"] for r in load_results(out)}
    assert status[1] == status[2] == "ok"
    assert status[50000].startswith("too slow: decoding passed --max-seconds 0.2 s after ")
    assert status[50000].endswith("(last length reached: 2)")


@pytest.mark.parametrize("bad, message", [
    (["--methods", "softmax", "nope"], "unknown attention method 'nope'"),
    (["--methods", "nystrom"], "nystrom cannot decode token by token"),
    (["--methods", "rfa:bogus=1"], "rfa has no option 'bogus'"),
    (["--methods", "softmax", "--option", "num_features=8"],
     "'num_features' is not an option of any of softmax"),
    (["--methods", "softmax", "--option", "window"], "--option must look like key=value"),
    (["--methods", "num_features=8"], "does not follow a method"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 must be a multiple of --heads 4"),
])
def test_bad_method_entries_and_settings_exit_2(bad, message, tmp_path, capsys):
    assert main(["decode", *bad, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("bad, message", [
    (["--lengths", "0"], "expected a positive integer"),
    (["--batch", "two"], "expected a positive integer"),
    (["--max-seconds", "-1"], "expected a positive number"),
    (["--device", "tpu"], "bad device 'tpu'"),
])
def test_bad_arguments_exit_2(bad, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["decode", *bad, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_method_entries_and_options():
    decoding = [m for m in effattn.methods() if effattn.spec(m).decoding]
    expected = [(m, {}) for m in decoding] + [("rfa", {"gated": True})]
    assert parse_methods(["default"]) == expected == parse_methods(["all"])
    assert parse_methods(["softmax,rfa:gated=true,num_features=8,linear", "softmax"]) == [
        ("softmax", {}), ("rfa", {"gated": True, "num_features": 8}), ("linear", {})]
    configs = make_configs([("softmax", {}), ("performer", {}), ("rfa", {"num_features": 4})],
                           ["num_features=8"], [1, 16], lengths=(8,))
    assert [(c.label, c.batch) for c in configs] == [
        ("softmax", 1), ("softmax", 16), ("performer:num_features=8", 1),
        ("performer:num_features=8", 16), ("rfa:num_features=4", 1), ("rfa:num_features=4", 16)]


def _decoded(method, steps, **options):
    model = DecoderLM(32, 16, 2, 2, method, seed=0, **options).eval()
    with torch.inference_mode():
        logits, state = model.prefill(torch.randint(32, (2, 3)))
        token = logits[:, -1].argmax(-1)
        for _ in range(steps):
            logits, state = model.step(token, state)
            token = logits.argmax(-1)
    return state


@pytest.mark.parametrize("method, options", [
    ("rfa", {"gated": True}), ("performer", {"num_features": 8}), ("favor", {"num_features": 8}),
    ("local", {"window": 4}),
])
def test_fixed_size_states_do_not_grow(method, options):
    sizes = [decode.decoder_state_bytes(_decoded(method, n, **options)) for n in (5, 9, 20)]
    assert len(set(sizes)) == 1 and sizes[0][0] == sizes[0][1] > 0


def test_state_bytes_in_use_and_allocated():
    k, v = torch.zeros(2, 3, 16, 4), torch.zeros(2, 3, 16, 5)
    cache = KVCache.empty(k, v, capacity=16)
    cache.extend(k[:, :, :10], v[:, :, :10])
    assert decode.state_bytes(cache) == (2 * 3 * 10 * 9 * 4, 2 * 3 * 16 * 9 * 4)
    ring = WindowCache(k[:, :, :8], v[:, :, :8], 3)
    assert decode.state_bytes(ring) == (2 * 3 * 3 * 9 * 4, 2 * 3 * 8 * 9 * 4)
    ring.length = 100
    assert decode.state_bytes(ring) == (2 * 3 * 8 * 9 * 4,) * 2
    rec = RecurrentState.empty(2, 3, 7, 5, k)
    assert decode.state_bytes(rec) == (rec.nbytes(), rec.nbytes()) == ((2 * 3 * 7 * 6 + 6) * 4,) * 2
    with pytest.raises(TypeError, match="no byte count"):
        decode.state_bytes(object())


def test_decode_points_keep_the_lengths_reached_when_a_step_fails():
    model = DecoderLM(32, 16, 2, 1, "softmax", seed=0).eval()
    with torch.inference_mode():
        logits, state = model.prefill(torch.randint(32, (1, 3)))
    calls = []

    def step(token, state):
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model.step(token, state)

    points = decode.decode_points(step, logits[:, -1].argmax(-1), state, [4, 2, 8, 16],
                                  max_seconds=60.0)
    assert [p["length"] for p in points] == [2, 4, 8, 16]
    assert [p["status"] for p in points[:2]] == ["ok", "ok"]
    assert points[2]["status"] == points[3]["status"]
    assert points[2]["status"].startswith("oom: CUDA out of memory")
    assert points[1]["state_bytes"] == 1 * 2 * (3 + 4) * 2 * 8 * 4


def test_make_records_from_points_or_the_run_status():
    cfg = decode.DecodeConfig("rfa", (8, 16), options=(("gated", True),), batch=4)
    fields = cfg.fields(8)
    assert fields["method"] == "rfa:gated=True" and fields["batch"] == 4
    result = {"status": "ok", "points": [
        {"length": 8, "status": "ok", "ms_per_token": 2.0, "tokens_per_s": 400.0,
         "decode_s": 0.02, "state_bytes": 2**20, "state_alloc_bytes": 2**20, "peak_mib": 0.5},
        {"length": 16, "status": "too slow: ..."}]}
    ok, slow = decode.make_records(cfg, result)
    assert ok["status"] == "ok" and ok["state_mib"] == 1.0 and ok["length"] == 8
    assert slow["status"] == "too slow: ..." and slow["ms_per_token"] is None
    assert slow["state_mib"] is None
    timeout = decode.make_records(cfg, {"status": "timeout: no result within --timeout 1 s"})
    assert [r["status"] for r in timeout] == ["timeout: no result within --timeout 1 s"] * 2


def _rec(method, batch, length, ms, tps, state, status="ok"):
    ok = status == "ok"
    return {"method": method, "batch": batch, "length": length, "status": status,
            "ms_per_token": ms if ok else None, "tokens_per_s": tps if ok else None,
            "state_bytes": state if ok else None}


RECORDS = [
    _rec("softmax", 1, 128, 1.0, 1000.0, 1000), _rec("softmax", 1, 2048, 2.0, 600.0, 16000),
    _rec("softmax", 1, 8192, 4.0, None, None, "too slow: ..."),
    _rec("rfa", 1, 128, 0.5, 2000.0, 800), _rec("rfa", 1, 2048, 0.55, 1800.0, 800),
    _rec("rfa", 1, 8192, 0.6, 1700.0, 800),
    _rec("softmax", 16, 128, 2.0, 8000.0, 16000), _rec("softmax", 16, 2048, 8.0, 4000.0, 256000),
    _rec("rfa", 16, 128, 1.0, 16000.0, 12800),
    _rec("rfa", 16, 2048, 1.0, None, None, "oom: ..."),
]


def test_summary_numbers_are_computed_from_the_records():
    assert decode.flatness(RECORDS, "rfa", 1) == pytest.approx((1.2, 128, 8192))
    assert decode.flatness(RECORDS, "softmax", 1) == pytest.approx((2.0, 128, 2048))
    assert decode.flatness(RECORDS, "rfa", 16) is None  # one length reached
    assert decode.state_percent(RECORDS, "rfa", 1, 2048) == pytest.approx(5.0)
    assert decode.state_percent(RECORDS, "rfa", 16, 2048) is None
    assert decode.speedups(RECORDS, "rfa", 1) == {
        "tokens_per_s": pytest.approx({128: 2.0, 2048: 3.0}),
        "at_position": pytest.approx({128: 2.0, 2048: 2.0 / 0.55})}

    rows = {(r["method"], r["batch"]): r for r in decode.summarize(RECORDS, 2048)}
    assert list(rows) == [("softmax", 1), ("rfa", 1), ("softmax", 16), ("rfa", 16)]
    rfa1 = rows["rfa", 1]
    assert rfa1["flatness"] == pytest.approx(1.2) and rfa1["flatness_lengths"] == [128, 8192]
    assert rfa1["flat_goal_met"] is True
    assert rfa1["state_pct_of_softmax"] == pytest.approx(5.0) and rfa1["state_goal_met"] is True
    assert rfa1["speedup_at_goal_length"] == pytest.approx(3.0)
    # softmax was too slow at 8192: its flatness spans 128 -> 2048, short of the goal's span.
    assert rows["softmax", 1]["flat_goal_met"] is None
    assert rows["softmax", 1]["state_pct_of_softmax"] == 100.0
    assert rows["softmax", 1]["state_goal_met"] is False
    rfa16 = rows["rfa", 16]
    assert rfa16["flatness"] is None and rfa16["flat_goal_met"] is None
    assert rfa16["state_goal_met"] is None and rfa16["speedup_at_goal_length"] is None
    assert rfa16["speedup"] == pytest.approx({128: 2.0})

    # Goals are judged only where they are defined: the state goal at 2048 tokens, the flatness
    # goal from 128 to 8192 tokens.
    short = {(r["method"], r["batch"]): r for r in decode.summarize(
        [r for r in RECORDS if r["length"] <= 2048], 128)}
    assert short["rfa", 1]["state_pct_of_softmax"] == pytest.approx(80.0)
    assert short["rfa", 1]["state_goal_met"] is None
    assert short["rfa", 1]["flatness_lengths"] == [128, 2048]
    assert short["rfa", 1]["flat_goal_met"] is None

    speedup = {(r["method"], r["batch"], r["length"]): r["speedup"]
               for r in decode.with_speedup(RECORDS)}
    assert speedup["rfa", 1, 2048] == pytest.approx(3.0) and speedup["softmax", 16, 128] == 1.0
    assert speedup["rfa", 1, 8192] is None and speedup["rfa", 16, 2048] is None
