"""utils/procs.child_env: the children's OpenMP threads wait with a short bounded spin, then
sleep (OMP_WAIT_POLICY=PASSIVE + GOMP_SPINCOUNT), unless the user set either."""

from __future__ import annotations

import pytest

from radix_runtime.utils import procs


@pytest.fixture
def bare(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_children_spin_briefly_then_sleep(bare):
    env = procs.child_env({"X": "1"})
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["GOMP_SPINCOUNT"] == procs.OMP_SPIN_COUNT
    assert 0 < int(procs.OMP_SPIN_COUNT) < 300_000  # below libgomp's default spin
    assert env["X"] == "1" and env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize(
    "ours", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}]
)
@pytest.mark.parametrize("where", ["environ", "argument"])
def test_a_wait_policy_of_the_users_is_left_alone(bare, ours, where):
    if where == "environ":
        for name, value in ours.items():
            bare.setenv(name, value)
        env = procs.child_env()
    else:
        env = procs.child_env(ours)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        assert env.get(name) == ours.get(name)
