"""`kvtier simulate` end to end: tables, --json, PNG plots, and bad flags."""
import json

from kvtier_app import cli


def test_simulate_writes_json_and_png_plots(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = cli.main(["simulate", "compare", "--requests", "2000", "--policies", "random,kvtier,oracle",
                   "--json", str(out), "--plots", str(tmp_path / "plots"), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "kvtier" in text and "granularity" in text
    report = json.loads(out.read_text())
    runs = {r["label"]: r for r in report[0]["results"]}
    assert set(runs) == {"random", "kvtier", "oracle"}
    assert runs["oracle"]["hit_rate"] >= runs["random"]["hit_rate"]
    pngs = list((tmp_path / "plots").glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_capacity_plot_has_one_curve_per_policy(tmp_path):
    rc = cli.main(["simulate", "capacity", "--requests", "1500", "--policies", "random,kvtier,oracle",
                   "--dram-gib", "5,40", "--json", str(tmp_path / "c.json"), "--plots", str(tmp_path),
                   "--no-progress"])
    assert rc == 0
    labels = [r["label"] for r in json.loads((tmp_path / "c.json").read_text())[0]["results"]]
    assert labels == ["random@5GiB", "kvtier@5GiB", "oracle@5GiB", "random@40GiB", "kvtier@40GiB"]
    assert (tmp_path / "hit_rate_vs_capacity.png").exists()


def test_bad_flags_exit_2_and_name_the_flag(capsys):
    assert cli.main(["simulate", "compare", "--policies", "random,bogus"]) == 2
    assert "--policies" in capsys.readouterr().err
    assert cli.main(["simulate", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
    assert cli.main(["simulate", "capacity", "--dram-gib", "5,x"]) == 2
    assert "--dram-gib" in capsys.readouterr().err
    assert cli.main(["simulate", "no-such-scenario"]) == 2


def test_simulate_rollout_design_notes_reports_the_dip_figures(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["simulate", "rollout-design-notes", "--tenants", "20", "--requests", "2500", "--json", str(out),
                   "--no-progress"])
    assert rc == 0
    assert "hit-rate dip depth ratio, warmed before ready at the same extra prefill / cold rolling" in \
        capsys.readouterr().out
    rep = json.loads(out.read_text())[0]
    assert rep["name"] == "rollout-design-notes" and rep["params"]["warm_before_ready_tokens"] == 655
    assert any(r["label"] == "no rollout (control)" for r in rep["results"])


def test_simulate_rollout_bad_flags_exit_2(capsys):
    assert cli.main(["simulate", "rollout-design-notes", "--warm-tokens", "-1"]) == 2
    assert "--warm-tokens" in capsys.readouterr().err
    assert cli.main(["simulate", "rollout-design-notes", "--tenants", "0"]) == 2
    assert "--tenants" in capsys.readouterr().err
    assert cli.main(["simulate", "rollout-trace", "--trace", "/no/such/file"]) == 2
    assert "--trace" in capsys.readouterr().err
