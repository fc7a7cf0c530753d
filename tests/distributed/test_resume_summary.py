"""The run summary of a resumed run counts the samples of its own steps: its throughput is this
run's samples over this run's training time (was: every step since step 0 over this run's time)."""

from __future__ import annotations

import re

from tests.support.cli import run_hybrid

DEMO = ["--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml"]
SMALL = ["model.num_embeddings=200", "model.bottom_mlp=[16,16]", "model.top_mlp=[16,1]", "data.batch_size=16",
         "data.eval_batches=1", "train.eval_every=0", "train.plot=false", "train.progress=false"]


def _summary(out: str) -> dict[str, str]:
    text = out[out.index("== hybrid run summary =="):]
    return dict(m.groups() for m in re.finditer(r"^  (\S+(?: \S+)?)\s{2,}(.*)$", text, re.M))


def test_a_resumed_run_reports_the_samples_and_throughput_of_its_own_steps(tmp_path):
    base = ["launch", "-n", "1", "train", *DEMO, *SMALL, f"checkpoint.dir={tmp_path / 'ck'}",
            f"train.out_dir={tmp_path / 'out'}"]
    res = run_hybrid([*base, "train.steps=4"], timeout=240)
    assert res.returncode == 0, res.output
    assert _summary(res.stdout)["steps"] == "4 (64 samples, 0 batches skipped)", res.stdout
    res = run_hybrid([*base, "train.steps=6", "checkpoint.resume=latest"], timeout=240)
    assert res.returncode == 0, res.output
    s = _summary(res.stdout)
    assert s["steps"] == "6 (32 samples from step 4, 0 batches skipped)", res.stdout
    seconds = float(re.match(r"([\d.]+)s training", s["time"]).group(1))
    if seconds >= 0.1:  # printed to 0.1 s: the rate it gives is then within a factor of 1.5 of the shown one
        rate = float(s["throughput"].split()[0].replace(",", ""))
        assert 32 / (seconds + 0.05) <= rate <= 32 / (seconds - 0.05), s
    # train.steps equal to the checkpoint's step: no step runs, so there is no throughput to show
    res = run_hybrid([*base, "train.steps=6", "checkpoint.resume=latest"], timeout=240)
    assert res.returncode == 0, res.output
    s = _summary(res.stdout)
    assert s["steps"] == "6 (0 samples from step 6, 0 batches skipped)" and s["throughput"] == "n/a", res.stdout
    assert s["step time"] == "n/a" and "nan" not in s["ps0"], res.stdout
