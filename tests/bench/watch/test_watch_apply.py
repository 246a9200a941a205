"""``dlstore watch --apply`` (the advice put into the script's own DataLoader, measured beside predicted),
``--compare A B``, and the data timeline.png draws; real scripts in a child Python through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset, get_worker_info

from dlstore.bench.watch import WatchConfig
from dlstore.bench.watch.analyse import loop_rate
from dlstore.bench.watch.launch import advised_settings, inject
from dlstore.bench.watch.watch_report import rates_top, timeline_series
from dlstore.cli import main
from dlstore.machine import usable_cores

# Each sample sleeps (an I/O-bound read: workers overlap it whatever else loads the machine) and says which
# worker count made it; every step logs that, and what the loader object itself says, with the pid.
SLOW_READS = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

class SlowReads(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.004)
        info = get_worker_info()
        return torch.full((3, 8, 8), float(i)), info.num_workers if info else 0

loader = DataLoader(SlowReads(), batch_size=4, shuffle=True, num_workers=0)
with open(sys.argv[1], "a") as log:
    for epoch in range(3):
        for x, made_by in loader:
            (x * 2).sum()
            log.write(f"{os.getpid()} {int(made_by.max())} {loader.num_workers} {loader.persistent_workers}\\n")
            log.flush()
"""

FAILS = """
import torch
from torch.utils.data import DataLoader, TensorDataset

for i, (x,) in enumerate(DataLoader(TensorDataset(torch.randn(64, 3)), batch_size=4)):
    if i == 7:
        raise RuntimeError("boom")
"""

QUICK = ["--parts-budget", "0.3", "--replay-s", "0.3", "--trial-s", "0.5", "--warmup", "3"]


@pytest.fixture(scope="module")
def applied(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    """One --apply run: (its JSON document, its --out folder, the script's per-step log)."""
    if usable_cores() < 2:
        pytest.skip("the workers advice needs a second core")
    tmp = tmp_path_factory.mktemp("apply")
    script, log, out = tmp / "train.py", tmp / "steps.log", tmp / "out"
    script.write_text(textwrap.dedent(SLOW_READS))
    args = [
        "watch",
        *QUICK,
        "--apply",
        "--steps",
        "14",
        "--out",
        str(out),
        "--json",
        "--",
        "python",
        str(script),
    ]
    result = CliRunner().invoke(main, [*args, str(log)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out, log


def test_apply_puts_the_advised_settings_into_the_scripts_loader(
    applied: tuple[dict[str, Any], Path, Path],
) -> None:
    doc, out, log = applied
    a = doc["applied"]
    n = a["settings"]["num_workers"]
    assert n >= 2 and a["settings"]["persistent_workers"] is True and a["reached"]
    runs: dict[str, list[list[str]]] = {}
    for line in log.read_text().splitlines():
        pid, *rest = line.split()
        runs.setdefault(pid, []).append(rest)
    first, second = runs.values()  # two processes: the script as written, then with the advice
    assert {tuple(r[1:]) for r in first} == {("0", "False")}
    assert {r[0] for r in first[:14]} == {"0"}  # its own batches (the trial's later come from workers)
    # every batch came from n workers, and the script's own loader object says so
    assert {tuple(r) for r in second} == {(str(n), str(n), "True")} and len(second) >= 14


def test_apply_reports_measured_beside_predicted(applied: tuple[dict[str, Any], Path, Path]) -> None:
    doc, out, _ = applied
    saved = json.loads((out / "watch.json").read_text())
    a = saved["applied"]
    assert a == doc["applied"]
    # --apply's settings are the advice's own structured fields, as watch.json holds them
    workers = next(x for x in saved["advice"] if x.get("workers"))
    assert a["settings"] == advised_settings(saved)[0] == workers["settings"]
    assert workers["command"] == f"DataLoader(..., num_workers={workers['workers']}, persistent_workers=True)"
    assert a["predicted_img_per_s"] == max(x["expected_img_per_s"] for x in saved["advice"])
    assert a["measured_img_per_s"] > 0 and a["error"] == pytest.approx(
        a["measured_img_per_s"] / a["predicted_img_per_s"] - 1
    )
    second = json.loads((out / "applied" / "watch.json").read_text())
    assert saved["status"] == second["status"] == "stopped"  # --steps held both runs
    rep = next(r for r in second["loaders"] if r["index"] == a["loader"])
    assert rep["settings"]["num_workers"] == a["settings"]["num_workers"]
    assert a["measured_img_per_s"] == loop_rate(rep)
    assert a["before_img_per_s"] == loop_rate(next(r for r in saved["loaders"] if r["index"] == 0))
    # the timeline's bars: now, with data free, the fix as predicted, and as measured after --apply
    rates = {b["kind"]: b["img_per_s"] for b in timeline_series(saved)["rates"]}
    assert rates["measured"] == a["measured_img_per_s"]
    assert rates["predicted"] == a["predicted_img_per_s"]
    assert rates["now"] == pytest.approx(a["before_img_per_s"])  # one epoch: no epoch start in either


def test_compare_two_runs(applied: tuple[dict[str, Any], Path, Path]) -> None:
    doc, out, _ = applied
    result = CliRunner().invoke(main, ["watch", "--compare", str(out), str(out / "applied" / "watch.json")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    workers = next(ln for ln in lines if ln.startswith("num_workers")).split()
    assert workers[1:] == ["0", str(doc["applied"]["settings"]["num_workers"])]
    before, after = doc["applied"]["before_img_per_s"], doc["applied"]["measured_img_per_s"]
    change = 100 * (after / before - 1)
    word = "faster" if change >= 0 else "slower"
    assert lines[-1] == f"B vs A: {abs(change):.0f}% {word} ({after:,.0f} vs {before:,.0f} img/s)."
    as_json = CliRunner().invoke(main, ["watch", "--compare", str(out), str(out / "applied"), "--json"])
    cmp = json.loads(as_json.stdout)
    assert cmp["a"]["num_workers"] == 0 and cmp["b"]["loop_img_per_s"] == after
    assert cmp["a"]["binds"] == doc["loaders"][0]["binding"]["stage"]


def test_compare_refuses_a_file_that_is_not_a_watch_report(tmp_path: Path) -> None:
    other = tmp_path / "result.json"
    other.write_text(json.dumps({"runs": []}))
    result = CliRunner().invoke(main, ["watch", "--compare", str(other), str(other)])
    assert result.exit_code == 1
    assert f"{other}: not a watch.json" in result.output and "Traceback" not in result.output


def test_apply_after_a_failing_script_applies_nothing(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(FAILS))
    result = CliRunner().invoke(main, ["watch", *QUICK, "--apply", "--", "python", str(script)])
    assert result.exit_code == 1
    assert "--apply: the script ended with exit code 1: nothing was applied." in result.output


def test_advised_settings_come_from_the_advice_records() -> None:
    advice = [
        {"settings": {"num_workers": 8, "persistent_workers": True, "pin_memory": True}},
        {"settings": {"persistent_workers": True, "prefetch_factor": 4}},
        {"settings": {"num_workers": 4}},  # a lower-ranked advice: the first one's count holds
        {"command": "dlstore convert imgs DEST --size 64; ds = dlstore.CachedDataset(DEST, num_workers=2)"},
        {"command": None},
    ]
    settings, used = advised_settings({"advice": advice})
    assert settings == {
        "num_workers": 8,
        "persistent_workers": True,
        "pin_memory": True,
        "prefetch_factor": 4,
    }
    assert used == advice[:3]


class WhoMadeIt(Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        info = get_worker_info()
        return info.num_workers if info else 0


def test_inject_changes_only_the_advised_loader_before_its_first_epoch() -> None:
    class Session:
        config = WatchConfig(apply={"loader": 1, "settings": {"num_workers": 2, "persistent_workers": True}})
        records: dict[int, Any] = {}

    s = Session()
    first, second = DataLoader(WhoMadeIt(), batch_size=4), DataLoader(WhoMadeIt(), batch_size=4)
    inject(s, first)
    s.records[id(first)] = "seen"  # the first loader iterated: index 0, not the advised one
    inject(s, second)
    assert torch.cat(list(first)).tolist() == [0] * 8
    assert second.num_workers == 2 and second.persistent_workers and second.prefetch_factor == 2
    assert torch.cat(list(second)).tolist() == [2] * 8
    assert second._iterator is not None  # persistent: the workers stay for the next epoch
    second._iterator._shutdown_workers()


def rows(phases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    out = []
    for phase, n in phases:
        for _ in range(n):
            ms = 1.0 if phase == "replay" else 20.0 + len(out) % 3
            out.append(
                {
                    "step": len(out),
                    "phase": phase,
                    "wait_s": ms / 1e3,
                    "host_s": 0.002,
                    "device_s": None,
                }
            )
    return out


def report(phases: list[tuple[str, int]], applied: dict[str, Any] | None = None) -> dict[str, Any]:
    rep = {
        "index": 0,
        "rows": rows(phases),
        "steady": {"img_per_s": 300.0},
        "model": {"data_free_img_per_s": 6000.0},
        "advice": [
            {
                "text": "Use 2 DataLoader workers (…): predicted 400 img/s",
                "expected_img_per_s": 400.0,
                "workers": 2,
            },
            {"text": "Pin the batches: the copy …", "expected_img_per_s": 350.0},
            {"text": "The training step binds, not the input", "expected_img_per_s": None},
        ],
    }
    return {"primary": 0, "loaders": [rep], **({"applied": applied} if applied else {})}


def test_timeline_keeps_the_real_steps_wide_beside_a_long_replay() -> None:
    """Issue 40 item 8: 139 replayed steps squeezed 13 real ones to the left edge; the trial and refill
    carried no label."""
    phases = [("warmup", 5), ("real", 8), ("replay", 139), ("trial", 40), ("refill", 3), ("real", 2)]
    series = timeline_series(report(phases))
    assert series is not None
    cols, spans = series["columns"], series["spans"]
    assert [(s["phase"], s["steps"]) for s in spans] == phases
    width = {p: sum(s["x1"] - s["x0"] for s in spans if s["phase"] == p) for p, _ in phases}
    assert width["warmup"] == 5 and width["real"] == 10 and width["refill"] == 3  # a column per step
    assert width["replay"] == width["trial"] == 8  # stand-ins compacted
    assert sum(width[p] for p in ("warmup", "real", "refill")) > len(cols) / 2
    assert sum(c["steps"] for c in cols) == sum(n for _, n in phases)
    replay = [c for c in cols if c["phase"] == "replay"]
    assert all(c["wait_ms"] == pytest.approx(1.0) for c in replay) and sum(c["steps"] for c in replay) == 139
    real = [c for c in cols if c["phase"] == "real"]
    assert [c["steps"] for c in real] == [1] * 10 and real[0]["first_step"] == 5
    assert real[0]["wait_ms"] == pytest.approx(20.0 + 5 % 3) and real[0]["host_ms"] == pytest.approx(2.0)


def test_a_long_run_is_drawn_in_bounded_columns_and_rates_name_each_fix() -> None:
    series = timeline_series(
        report([("warmup", 5), ("real", 5000), ("replay", 2000)], {"measured_img_per_s": 390})
    )
    assert series is not None
    assert len(series["columns"]) <= 400 and sum(c["steps"] for c in series["columns"]) == 7005
    assert [(b["kind"], b["img_per_s"]) for b in series["rates"]] == [
        ("now", 300.0),
        ("data free", 6000.0),
        ("predicted", 400.0),
        ("predicted", 350.0),
        ("measured", 390),
    ]
    assert [b["label"].split("\n")[0] for b in series["rates"]][2:] == [
        "2 workers",
        "Pin the batches",
        "after --apply",
    ]
    assert rates_top(series["rates"]) == pytest.approx(1.3 * 400)  # data free (over 3x the rest) runs off
    assert rates_top(series["rates"][:1]) == pytest.approx(1.3 * 300)


def one_loader(workers: int, rate: float) -> dict[str, Any]:
    rep = {"index": 0, "settings": {"num_workers": workers, "pin_memory": workers > 0}, "steps_observed": 9}
    return {"primary": 0, "exit_code": 0, "loaders": [{**rep, "steady": {"img_per_s": rate}}]}


def test_applied_summary_measures_only_a_loader_the_settings_reached() -> None:
    from dlstore.bench.watch.launch import applied_summary
    from dlstore.bench.watch.watch_report import apply_text

    used = [
        {"text": "Use 4 workers", "expected_img_per_s": 400.0, "command": "DataLoader(..., num_workers=4)"},
        {
            "text": "Pin the batches",
            "expected_img_per_s": 300.0,
            "command": "DataLoader(..., pin_memory=True); x = x.to('cuda', non_blocking=True)",
        },
    ]
    plan = {"loader": 0, "settings": {"num_workers": 4, "pin_memory": True}}
    first = one_loader(0, 100.0)
    a = applied_summary(first, one_loader(4, 360.0), plan, used)
    assert (a["before_img_per_s"], a["predicted_img_per_s"], a["measured_img_per_s"]) == (100.0, 400.0, 360.0)
    assert a["reached"] and a["error"] == pytest.approx(-0.1)
    assert a["not_applied"] == ["x = x.to('cuda', non_blocking=True)"]
    first["applied"] = a
    text = apply_text(first, one_loader(4, 360.0))
    assert "measured 360 img/s, predicted 400 (-10%)" in text and "non_blocking=True" in text
    assert text.endswith("applied vs as written: 260% faster (360 vs 100 img/s).")
    missed = applied_summary(first, one_loader(2, 360.0), plan, used)  # another loader took index 0
    assert not missed["reached"] and missed["measured_img_per_s"] is None and missed["error"] is None


def test_applied_summary_measures_on_the_predictions_basis_epoch_starts_included() -> None:
    """The advice predicts the loop's rate with later epochs' starts (worker start-up included); the
    measured figure beside it must be that rate too, not the steady one that leaves them out."""
    from dlstore.bench.watch.launch import applied_summary

    used = [
        {"text": "Use 4 workers", "expected_img_per_s": 400.0, "command": "DataLoader(..., num_workers=4)"}
    ]
    plan = {"loader": 0, "settings": {"num_workers": 4}}
    first, second = one_loader(0, 120.0), one_loader(4, 700.0)
    first["loaders"][0]["model"] = {"measured_img_per_s": 100.0}
    second["loaders"][0]["model"] = {"measured_img_per_s": 420.0}  # the steady 700 leaves epoch starts out
    a = applied_summary(first, second, plan, used)
    assert (a["before_img_per_s"], a["measured_img_per_s"]) == (100.0, 420.0)
    assert a["error"] == pytest.approx(420 / 400 - 1)
