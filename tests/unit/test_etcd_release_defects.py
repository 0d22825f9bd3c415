"""The etcd releases with a known defect the rendezvous meets: 3.5.0 and 3.5.1 can crash catching up lagging
watchers (etcd-io/etcd#13505, fixed in 3.5.2; 3.4 never had it)."""

from __future__ import annotations

import pytest

from launcher.etcd.versions import defect_of


@pytest.mark.parametrize(
    "version, fixed_in",
    [("3.5.0", "3.5.2"), ("3.5.1", "3.5.2"), ("3.5.2", None), ("3.5.17", None), ("3.4.23", None), ("3.6.0", None)],
)
def test_known_defects_by_release(version: str, fixed_in: str | None) -> None:
    defect = defect_of(version)
    assert (defect.fixed_in if defect is not None else None) == fixed_in
    if defect is not None:
        assert defect.describe(version).startswith(f"etcd {version} can crash")
