"""`make test` relies on xdist's `--dist loadgroup` (tests/conftest.py): the tests that need the cores to
themselves one at a time on one worker, a file's tests together. On pytest 9.2 pytest-xdist 3.8 silently
stops grouping (the group never reaches the test's node id), so those tests would run beside each
other: this fails then."""

from __future__ import annotations

import pytest


def test_under_loadgroup_every_test_carries_its_group(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not an xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@" + request.node.nodeid.split("::")[0]), request.node.nodeid
