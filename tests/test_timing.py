"""Timings a user can trust: the disturbance judge, the retrying measurement and sweep (on
injected fake timings: nothing here is timed), the rate-above-peak flag and the CPU description."""

import pytest
from conftest import assert_png

from effattn.tools.bench import machine, plots, results, speed, timing
from effattn.tools.bench.speed import Config, Settings, measure_guarded
from effattn.tools.bench.timing import MAX_SLOWDOWN, judge

# /proc/cpuinfo excerpts (first processor; later ones repeat it).
EPYC = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512dq avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2
"""
HASWELL = """\
processor\t: 0
model\t\t: 63
model name\t: Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
"""
SAPPHIRE = """\
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
GRAVITON = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve sve2 bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize("text, model, extensions", [
    (EPYC, "AMD EPYC 9654 96-Core Processor", ["AVX2", "AVX-512 F", "AVX-512 BF16"]),
    (HASWELL, "Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz", ["AVX2"]),
    (SAPPHIRE, "Intel(R) Xeon(R) Platinum 8480+",
     ["AVX2", "AVX-512 F", "AVX-512 BF16", "AMX", "AMX BF16"]),
    (GRAVITON, None, ["NEON", "SVE", "SVE2", "BF16"]),
    ("", None, []),
])
def test_parse_cpuinfo(text, model, extensions):
    assert machine.parse_cpuinfo(text) == (model, extensions)


def test_machine_info_describes_this_machine():
    info = machine.machine_info()
    assert info["torch_threads"] >= 1 and isinstance(info["vector_extensions"], list)
    info |= {"cpu_model": "AMD EPYC", "vector_extensions": ["AVX2", "AVX-512 BF16"],
             "matmul_peak_gflops": {"float32": 205.3, "bfloat16": None}, "reference_ms": 1.31}
    assert machine.cpu_label(info) == "AMD EPYC (AVX2, AVX-512 BF16)"
    line = machine.describe(info)
    assert line.startswith("machine: AMD EPYC (AVX2, AVX-512 BF16), ")
    assert line.endswith("; matmul peak float32 205 GFLOP/s, bfloat16 n/a; reference GEMM 1.31 ms")
    assert machine.cpu_label({"vector_extensions": []}) == "unknown CPU"


def test_judge_quiet_machine():
    v = judge([1.05, 1.1], 1.0, median_ms=40.0, iqr_ms=2.0)
    assert not v.disturbed and v.slowdown == pytest.approx(1.1) and v.spread == 0.05


def test_judge_busy_machine_with_a_small_spread():
    # A machine busy with other work: every call 10-25x slower, the samples tight.
    v = judge([12.0, 11.0], 1.0, median_ms=400.0, iqr_ms=4.0)
    assert v.disturbed and v.slowdown == 12.0


def test_judge_load_that_starts_during_the_measurement():
    # Against its own faster reference even when the sweep's quiet time is stale.
    assert judge([1.0, 1.5], 3.0).disturbed
    assert not judge([1.0, 1.25], 3.0).disturbed


def test_judge_spread_and_threshold():
    assert judge([1.0], 1.0, median_ms=10.0, iqr_ms=3.0).disturbed
    assert not judge([1.0], 1.0, median_ms=10.0, iqr_ms=2.0).disturbed
    assert judge([1.0], 1.0, median_ms=10.0, iqr_ms=2.0, max_spread=0.1).disturbed
    assert judge([1.0], 1.0).spread is None
    assert not judge([MAX_SLOWDOWN * 0.99], 1.0).disturbed
    assert judge([1.25], 1.0, max_slowdown=1.2).disturbed


@pytest.mark.parametrize("refs, quiet", [([], 1.0), ([1.0], 0.0), ([-1.0], 1.0)])
def test_judge_rejects_bad_times(refs, quiet):
    with pytest.raises(ValueError, match="reference"):
        judge(refs, quiet)


def test_time_fn_probes_between_the_samples():
    calls = []
    timing.time_fn(lambda: calls.append("call"), repeats=3, warmup=1, min_block_s=0.0,
                   between=lambda: calls.append("probe"))
    assert calls == ["call", "probe", "call", "probe", "call", "probe", "call"]


def _runs(*results):
    """A fake measurement returning ``results`` in turn (copies: the guard edits them)."""
    calls = []

    def run():
        calls.append(1)
        return dict(results[len(calls) - 1])

    return run, calls


def _ok(ms, *refs):
    return {"status": "ok", "median_ms": ms, "iqr_ms": 0.0, "reference_ms": list(refs)}


def test_guard_retries_until_quiet():
    run, calls = _runs(_ok(400.0, 10.0, 12.0), _ok(40.0, 1.0, 1.1))
    result, quiet = measure_guarded(run, 1.2, retries=2)
    assert len(calls) == 2 and quiet == 1.0
    assert result == {"status": "ok", "median_ms": 40.0, "iqr_ms": 0.0, "disturbed": False,
                      "slowdown": pytest.approx(1.1), "attempts": 2}


def test_guard_keeps_the_least_disturbed_and_marks_it():
    run, calls = _runs(_ok(400.0, 10.0), _ok(90.0, 2.0), _ok(300.0, 8.0), _ok(1.0, 1.0))
    result, quiet = measure_guarded(run, 1.0, retries=2)
    assert len(calls) == 3 and quiet == 1.0
    assert result["median_ms"] == 90.0 and result["disturbed"] and result["attempts"] == 3
    assert result["slowdown"] == 2.0


def test_guard_retries_too_slow_from_a_busy_machine():
    slow = {"status": "too slow: one call took 6 s > --max-seconds 5", "reference_ms": [9.0]}
    run, calls = _runs(slow, _ok(50.0, 1.0, 1.0))
    result, _ = measure_guarded(run, 1.0, retries=1)
    assert result["status"] == "ok" and result["attempts"] == 2


def test_guard_leaves_results_without_references_alone():
    run, calls = _runs({"status": "oom: cannot allocate"})
    assert measure_guarded(run, 1.0, retries=2) == ({"status": "oom: cannot allocate"}, 1.0)
    run, calls = _runs(_ok(40.0, 5.0))  # no quiet time: the machine probe failed
    result, quiet = measure_guarded(run, None, retries=2)
    assert len(calls) == 1 and quiet is None and "disturbed" not in result
    assert "reference_ms" not in result
    with pytest.raises(ValueError, match="retries"):
        measure_guarded(run, 1.0, retries=-1)


def test_machine_probe_measures_peaks_again_while_disturbed(monkeypatch):
    # A burst from the first round of peaks into the second: a third round is measured.
    references = iter([10.0, 30.0, 10.0, 10.0])  # the reference's rate, 27 GFLOP/s, is lower
    peaks = iter([30.0, 5.0, 50.0, 9.0, 80.0, 6.0])  # float32, bfloat16 per round
    monkeypatch.setattr(speed, "reference_gemm", lambda device: lambda: next(references))
    monkeypatch.setattr(speed, "matmul_peak", lambda dtype, device: next(peaks))
    info = speed.probe_machine(("float32", "bfloat16"), "cpu")["machine"]
    assert info["matmul_peak_gflops"] == {"float32": 80.0, "bfloat16": 9.0}
    assert info["reference_ms"] == 10.0 and "cpu_model" in info

    # The reference GEMM (2 * 512^3 FLOPs in 1 ms: 268 GFLOP/s) is an fp32 matmul too.
    references, peaks = iter([1.0, 1.0]), iter([30.0, 5.0])
    info = speed.probe_machine(("float32", "bfloat16"), "cpu")["machine"]
    assert info["matmul_peak_gflops"] == {"float32": pytest.approx(268.435456), "bfloat16": 5.0}


class FakeWorkers:
    """Stands in for ``run_isolated``: a machine probe, then each configuration's attempts."""

    def __init__(self, probes, measurements):
        self.probes, self.measurements = list(probes), dict(measurements)
        self.calls = []

    def __call__(self, target, args, timeout):
        if target is speed.probe_machine:
            self.calls.append("probe")
            reference, peak = self.probes.pop(0)
            return {"status": "ok", "machine": {
                "cpu_model": "Fake CPU", "vector_extensions": ["AVX2"], "reference_ms": reference,
                "matmul_peak_gflops": {"float32": peak, "bfloat16": 1.0}}}
        cfg = args[0]
        self.calls.append((cfg.method, cfg.length))
        return {"flops": 1e9, **self.measurements[(cfg.method, cfg.length)].pop(0)}


def test_sweep_retries_marks_and_remeasures_disturbed(tmp_path, monkeypatch):
    configs = [Config(method="softmax", length=n, pass_name="fwd") for n in (64, 128, 256)]
    workers = FakeWorkers([(1.0, 100.0)], {
        ("softmax", 64): [_ok(10.0, 1.0, 1.1)],
        ("softmax", 128): [_ok(90.0, 5.0), _ok(20.0, 1.0, 1.0)],
        ("softmax", 256): [_ok(400.0, 9.0), _ok(300.0, 8.0), _ok(350.0, 8.5)],
    })
    monkeypatch.setattr(speed, "run_isolated", workers)
    store = results.ResultStore(tmp_path)
    stats = speed.sweep(configs, store, Settings(retries=2), timeout=10.0, progress=False)
    assert (stats.measured, stats.retried, stats.disturbed) == (3, 3, 1)
    assert stats.machine["matmul_peak_gflops"]["float32"] == 100.0
    by_length = {r["length"]: r for r in store.records()}
    assert [by_length[n]["disturbed"] for n in (64, 128, 256)] == [False, False, True]
    assert by_length[128]["median_ms"] == 20.0 and by_length[128]["attempts"] == 2
    assert by_length[256]["median_ms"] == 300.0 and by_length[256]["slowdown"] == 8.0
    assert by_length[256]["attempts"] == 3
    assert by_length[256]["cpu"] == "Fake CPU (AVX2)"
    assert by_length[64]["gflops"] == pytest.approx(100.0)  # 1e9 FLOPs in 10 ms
    assert "disturbed" in (tmp_path / "results.csv").read_text().splitlines()[0]

    # A rerun measures again only what was disturbed.
    workers.probes.append((1.0, 100.0))
    workers.measurements[("softmax", 256)] = [_ok(100.0, 1.0, 1.0)]
    stats = speed.sweep(configs, results.ResultStore(tmp_path), Settings(), timeout=10.0,
                        progress=False)
    assert (stats.measured, stats.resumed, stats.disturbed) == (1, 2, 0)
    assert workers.calls[-2:] == ["probe", ("softmax", 256)]


def test_sweep_measures_peaks_again_when_the_first_probe_was_disturbed(tmp_path, monkeypatch):
    configs = [Config(method="softmax", length=64, pass_name="fwd")]
    # The first probe ran at a third of the speed; the configuration then showed the real one.
    workers = FakeWorkers([(3.0, 40.0), (1.0, 120.0)], {("softmax", 64): [_ok(10.0, 1.0, 1.0)]})
    monkeypatch.setattr(speed, "run_isolated", workers)
    stats = speed.sweep(configs, results.ResultStore(tmp_path), Settings(), timeout=10.0,
                        progress=False)
    assert workers.calls == ["probe", ("softmax", 64), "probe"]
    assert stats.machine["matmul_peak_gflops"]["float32"] == 120.0
    assert stats.machine["reference_ms"] == 1.0


def test_sweep_without_a_machine_probe_measures_unjudged(tmp_path, monkeypatch):
    def run_isolated(target, args, timeout):
        if target is speed.probe_machine:
            return {"status": "timeout: no result within --timeout 0.001 s"}
        return _ok(10.0, 5.0, 5.0)

    monkeypatch.setattr(speed, "run_isolated", run_isolated)
    configs = [Config(method="softmax", length=64, pass_name="fwd")]
    store = results.ResultStore(tmp_path)
    stats = speed.sweep(configs, store, Settings(), timeout=10.0, progress=False)
    assert stats.machine["probe_status"].startswith("timeout")
    (record,) = store.records()
    assert record["disturbed"] is None and record["median_ms"] == 10.0


def _rec(length, ms, gflops=None, disturbed=None, status="ok"):
    return {"method": "softmax", "length": length, "pass": "fwd", "status": status,
            "median_ms": ms, "peak_mib": 2.0, "gflops": gflops, "disturbed": disturbed}


def test_tables_mark_disturbed_and_above_peak_and_explain():
    records = [_rec(256, 1.5, 150.0, False), _rec(512, 4.0, 210.0, True),
               _rec(1024, None, None, True, "too slow: one call took 9 s"),
               {k: v for k, v in _rec(2048, 9.0, 90.0).items() if k != "disturbed"}]  # old
    assert results.table(records, "fwd").splitlines()[2].split() == [
        "softmax", "1.5", "4*", "too", "slow*", "9"]
    assert results.table(records, "fwd", "peak_mib").splitlines()[2].split() == [
        "softmax", "2", "2", "too", "slow*", "2"]  # memory does not suffer from the load
    gflops = results.table(records, "fwd", "gflops", ".0f", peak=200.0).splitlines()[2].split()
    assert gflops == ["softmax", "150", "210*!", "too", "slow*", "90"]
    assert [results.above_peak(r, 200.0) for r in records] == [False, True, False, False]
    assert not results.above_peak(records[1], None)
    lines = results.notes(records, 200.0)
    assert len(lines) == 2 and lines[0].startswith("* disturbed (2 of 4)")
    assert lines[1] == ("! above measured peak (200 GFLOP/s): the peak probe or the FLOP model "
                        "is off")
    assert results.notes(records[:1] + records[3:], 200.0) == []


def test_plots_hollow_disturbed_points_and_note_rates_above_peak(tmp_path):
    records = [_rec(256, 1.5, 150.0, False), _rec(512, 4.0, 210.0, True)]
    assert plots._series(records, "median_ms")["softmax"] == [(256, 1.5, False), (512, 4.0, True)]
    assert plots._series(records, "peak_mib")["softmax"] == [(256, 2.0, False), (512, 2.0, False)]
    fig, ax = plots.plt.subplots()
    plots.panel(ax, plots._series(records, "gflops"), [], xlabel="N", ylabel="GFLOP/s",
                 title="t", hlines={"peak": 200.0}, guides=False, logy=False)
    assert plots.DISTURBED_LABEL in ax.get_legend_handles_labels()[1]
    assert [t.get_text() for t in ax.texts] == [plots.ABOVE_PEAK_NOTE]
    plots.plt.close(fig)
    plots.plot_vs_length(records, tmp_path / "g.png", value="gflops", ylabel="GFLOP/s",
                         title="t", passes=["fwd"], hlines={"peak": 200.0})
    assert_png(tmp_path / "g.png")
