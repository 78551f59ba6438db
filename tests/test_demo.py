"""`dmdask demo --quick`: scikit-learn's digits through a cache smaller than the dataset."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")  # the demo extra (Pillow: the test extra)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table_rows(out: str) -> list:
    """The report's table: epoch, time, loss, acc | KiB, ratio, reads | RAM, SSD, streamed."""
    return [[float(v) for v in re.findall(r"[0-9.]+", line)]
            for line in out.splitlines() if re.match(r"\s+\d+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+\|", line)]


def demo_output_in_quickstart() -> str:
    text = open(os.path.join(ROOT, "docs", "quickstart.md")).read()
    return re.search(r"```\n\$ dmdask demo\n(.*?)```", text, flags=re.S).group(1)


def explanation_of(out: str) -> str:
    """The paragraph after the table."""
    return re.search(r"\n(Every epoch serves.*?)\n\n", out, flags=re.S).group(1)


@pytest.mark.slow
def test_demo_quick_learns_the_digits_and_reports_every_tier(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-m", "dmdask.cli", "demo", "--quick", "--no-progress",
                           "--data", str(tmp_path / "demo-data")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9, out
    # the table: epoch, time, loss, acc | KiB, ratio, reads | RAM, SSD, streamed
    rows = table_rows(out)
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    ram, ssd, streamed = (sum(r[i] for r in rows) for i in (7, 8, 9))
    assert ram > 0 and ssd > 0 and streamed > 0, out
    assert all(r[7] + r[8] + r[9] == 1438 for r in rows), out  # each training sample served once an epoch
    assert rows[1][4] < rows[0][4]  # from epoch 1 on, the cache spares the store
    assert "epochs 0-2" in out and "epochs 1-2" in out  # the summary numbers epochs as the table does
    # the explanation quotes epoch 0's row: the cached samples served from RAM and SSD, the rest streamed
    ram, ssd, streamed = (int(v) for v in rows[0][7:10])
    assert f"{ram + ssd} samples served from the cache ({ram} from RAM, {ssd} from SSD" in " ".join(out.split())
    assert f"the {streamed} samples it has no room for are streamed" in " ".join(out.split())
    # docs/quickstart.md shows what the demo prints: the same store bytes per epoch, the same
    # samples per tier from epoch 1 on, and in epoch 0 the same from SSD (the times, losses,
    # read counts and epoch 0's split between RAM and streamed vary from run to run)
    shown = table_rows(demo_output_in_quickstart())
    assert len(shown) >= 3
    assert [r[4:6] for r in shown[:3]] == [r[4:6] for r in rows], out
    assert [r[7:10] for r in shown[1:3]] == [r[7:10] for r in rows[1:]], out
    assert shown[0][8] == rows[0][8] and abs(shown[0][7] - rows[0][7]) <= 16, out
    def words(text):  # numbers left out: epoch 0's may differ by a few samples
        return re.sub(r"\d+", "N", " ".join(text.split()))

    assert words(explanation_of(out)) in words(demo_output_in_quickstart())
    assert re.search(r"dashboard: http://\S+/status  \(dmdask tiers: http://\S+/dmdask\)", out), out
    assert out.index("dashboard:") < out.index("epoch  time")  # printed before training starts
