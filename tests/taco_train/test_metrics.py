"""`metrics.MetricsWriter` on resume: the file reads like one run, and nothing is lost."""

import json

from taco_train import metrics


def _lines(*records) -> list[str]:
    return [json.dumps(r) + "\n" for r in records]


def test_a_resume_moves_later_records_aside_in_one_line(tmp_path, capsys):
    """Resuming at step 4: the records of steps 5 and 6, and a line a killed process left
    half-written, move to metrics.after-step-4.jsonl as they were; the file keeps steps 1-4."""
    path = tmp_path / "metrics.jsonl"
    early = _lines({"kind": "train", "step": 2}, {"kind": "checkpoint", "step": 4})
    late = _lines({"kind": "train", "step": 5}, {"kind": "eval", "step": 6})
    torn = '{"kind": "train", "st'
    path.write_text("".join(early + late) + torn)
    writer = metrics.MetricsWriter(path, start_step=4)
    assert path.read_text() == "".join(early)
    assert (tmp_path / "metrics.after-step-4.jsonl").read_text() == "".join(late) + torn + "\n"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 lines of metrics.jsonl" in err, err
    writer.write({"kind": "train", "step": 5, "loss": float("nan")})
    assert metrics.read_jsonl(path)[-1]["step"] == 5  # appended after the kept records


def test_a_second_resume_at_the_same_step_keeps_both_sets_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for loss in (1.0, 2.0):
        path.write_text("".join(_lines({"step": 1}, {"step": 3, "loss": loss})))
        metrics.MetricsWriter(path, start_step=1)
    assert json.loads((tmp_path / "metrics.after-step-1.jsonl").read_text())["loss"] == 1.0
    assert json.loads((tmp_path / "metrics.after-step-1.1.jsonl").read_text())["loss"] == 2.0


def test_a_fresh_or_caught_up_file_moves_nothing(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    metrics.MetricsWriter(path, start_step=0)  # no file yet
    assert path.read_text() == ""
    path.write_text("".join(_lines({"step": 1}, {"step": 2})))
    metrics.MetricsWriter(path, start_step=2)
    assert len(metrics.read_jsonl(path)) == 2
    assert list(tmp_path.glob("*.after-step-*")) == []
    assert capsys.readouterr().err == ""
