"""scripts/measure_profile.py: the profile it writes loads in the throughput model, and the whole
script runs end to end on tiny inputs (a real cluster, so ~30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts.measure_profile import build_profile, parse_args, workload
from services.planner import throughput as tm

ROOT = Path(__file__).resolve().parent.parent


def test_profile_round_trips_through_the_model():
    decode = [{"batch": 1, "step_s": 0.01, "ewma_step_s": 0.009, "steps": 100},
              {"batch": 8, "step_s": 0.02, "ewma_step_s": 0.018, "steps": 50}]
    p = build_profile("x", [128, 512], [0.05, 0.2], [1000, 4000], decode)
    hw = tm.HardwareProfile.from_dict(json.loads(json.dumps(p)))
    assert hw.decode_tokens_per_s == 8 / 0.02  # bs_max = largest batch, t_decode at that batch
    assert hw.t_prefill(320) == 0.125 and hw.s_kv(512) == 4000
    d = workload([128, 512], 1.0)
    assert (d.lo, d.hi) == (128, 512) and 128 < d.mean() < 512


def test_quick_defaults_are_small():
    a = parse_args(["--quick"])
    assert max(a.lengths) <= 2048 and a.reps <= 2 and max(a.batches) <= 8


def test_script_end_to_end(tmp_path):
    cmd = [sys.executable, "scripts/measure_profile.py", "--lengths", "64,256", "--reps", "1", "--batches", "1,2",
           "--decode-context", "64", "--window", "0.5", "--link-gbps", "1", "--local", "2", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    p = json.loads(Path(fields["profile"]).read_text())
    assert p["lengths"] == [64, 256] and p["bs_max"] == 2 and p["t_decode_s"] > 0
    assert all(v > 0 for v in p["prefill_s"]) and p["kv_bytes"][0] < p["kv_bytes"][1]
    hw = tm.HardwareProfile.from_dict(p)
    assert hw.decode_tokens_per_s > 0
    assert float(fields["lambda_max"]) > 0 and fields["bottleneck"] in tm.STAGES
