"""bench/common.py's provenance block, which every results file opens with."""

from __future__ import annotations

import subprocess
from datetime import datetime

from bench import common


def test_provenance_names_commit_date_machine_command_flags_and_ceiling(monkeypatch):
    for name in common.COMMAND_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    prov = common.provenance(
        "the cache-off server", {"cache_on": "--page-size 16"}, argv=["bench/x.py", "--out", "a b"]
    )
    assert prov["reconstructed"] is False
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert prov["commit"] == head.stdout.strip()
        assert isinstance(prov["dirty"], bool)
    assert datetime.fromisoformat(prov["date"]).tzinfo is not None
    assert prov["machine"]["cpus"] >= 1 and prov["machine"]["cpu_model"]
    assert "gpu" in prov["machine"]
    # the command reproduces the run from the repo root, environment that matters included
    assert prov["command"] == "OMP_WAIT_POLICY=PASSIVE python bench/x.py --out 'a b'"
    assert prov["server_flags"] == {"cache_on": "--page-size 16"}
    assert prov["ceiling"] == "the cache-off server"


def test_a_stated_commit_wins_over_git(monkeypatch):
    """The H200's checkout has no .git: run_h200.sh passes the commit in the environment."""
    monkeypatch.setenv("RADIX_RUNTIME_COMMIT", "abc123")
    assert common.git_commit() == ("abc123", None)


def test_the_script_path_is_made_relative_to_the_repo():
    argv = [str(common.REPO_ROOT / "bench" / "serving.py"), "--rates", "1"]
    assert common.command_line(argv).endswith("python bench/serving.py --rates 1")
